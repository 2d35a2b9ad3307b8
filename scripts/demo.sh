#!/usr/bin/env bash
# `make demo`: the local demo, no cluster and no GPU needed. Creates .venv on first
# use (scripts/bootstrap.sh), then starts one PP group of 2 node agents on the
# embedded backend, with 4 single-stage replicas of one model on the first agent
# and 1 on the second, drives them with synthetic engines (multi-turn
# conversations with shared prefixes) and prints a results table, with the
# cross-replica hits per node.
# Options go to `flexkv-agent demo` (see --help), e.g.:
#   bash scripts/demo.sh --conversations 32 --turns 6
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/bootstrap.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec python -m node_agent demo "$@"
