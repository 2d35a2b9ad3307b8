#!/usr/bin/env bash
# One virtual environment per runtime extra, each holding only that extra, so
# tests can prove every console script runs from its own install:
#   .venvs/agent     torch (CPU build, pinned first) + `pip install -e .[agent]`
#   .venvs/operator  `pip install -e .[operator]` (no torch, no pyzmq)
# Usage: scripts/extras_venvs.sh [agent|operator]...   (default: both)
# Idempotent: a stamp (hash of pyproject.toml and this script) marks a finished
# install; pip's cache makes a rebuild quick. Editable installs, so source edits
# need no reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
hash=$(cat pyproject.toml scripts/extras_venvs.sh | sha1sum | cut -c1-12)

make_venv() {
  local extra="$1" dir=".venvs/$1"
  local stamp="$dir/.installed-$hash"
  [ -f "$stamp" ] && return 0
  echo "== extras venv: $dir"
  rm -rf "$dir"
  "$PYTHON" -m venv "$dir"
  local pip=("$dir/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --upgrade pip
  if [ "$extra" = agent ]; then
    # The pin first: the agent extra's torch range would otherwise be free to
    # resolve to a multi-GB CUDA build.
    "${pip[@]}" "torch==${TORCH_VERSION}"
  fi
  "${pip[@]}" -e ".[$extra]"
  touch "$stamp"
}

extras=("$@")
[ ${#extras[@]} -eq 0 ] && extras=(agent operator)
for extra in "${extras[@]}"; do
  case "$extra" in
    agent|operator) make_venv "$extra" ;;
    *) echo "extras_venvs.sh: unknown extra '$extra'; use agent or operator" >&2; exit 2 ;;
  esac
done
