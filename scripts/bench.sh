#!/usr/bin/env bash
# `make bench`: run every benchmark in bench/ and collect their JSON lines in
# out/bench.jsonl (one object per result; each carries its own baseline ratio).
# Arguments are passed to every benchmark (for example --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
bash scripts/bootstrap_vllm.sh   # .venv-vllm for bench/vllm_ttft.py
# shellcheck disable=SC1091
. .venv/bin/activate
mkdir -p out
: > out/bench.jsonl
for b in transfer match restart codec fanout engine_api replicas lookup_http operator remote vllm_ttft; do
  echo "== bench/$b.py $*" >&2
  # -P: bench/ is not put on sys.path (bench/operator.py would shadow the stdlib module)
  python -P "bench/$b.py" "$@" | tee -a out/bench.jsonl
done
echo "Results in out/bench.jsonl" >&2
