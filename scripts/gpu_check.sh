#!/usr/bin/env bash
# GPU host check, minutes: the CUDA IPC path, copies between CUDA planes and a
# pinned tier, and, where SGLang imports, one SGLang request through the
# flexkv-agent plugin with a small generated model.
#   GPU_PYTHON=/path/to/python bash scripts/gpu_check.sh
# GPU_PYTHON (default python3) must have a CUDA build of torch (and SGLang for the
# second part). The check builds .venv-gpu on top of it (--system-site-packages;
# the project installed editable with the agent, sglang-plugin and dev extras)
# and exits 0 with SKIP lines where there is no GPU or no SGLang. Hosts without
# a package index: PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder of wheels>.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${GPU_PYTHON:-python3}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "SKIP gpu_check: no CUDA GPU visible to $PY (torch missing, CPU build, or no device);" \
       "set GPU_PYTHON to a python with a CUDA build of torch on a GPU host"
  exit 0
fi

venv=.venv-gpu
stamp=$venv/.installed-$(cat pyproject.toml scripts/gpu_check.sh | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  rm -rf "$venv"
  "$PY" -m venv --system-site-packages "$venv"
  # --system-site-packages reaches only the base interpreter's packages; where
  # GPU_PYTHON is itself a virtual environment, its own site-packages are added.
  "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' \
    > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gpu-python.pth"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[agent,sglang-plugin,dev]'
  touch "$stamp"
fi

echo "== CUDA IPC handles, GPU <-> tier copies and the GPU row kernel (-k 'cuda or gpu')"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/agent/test_engine_transport.py \
  tests/backend/test_row_plans.py tests/backend/test_mapped_rows.py -k "cuda or gpu"
echo "== CUDA KV buffers through the SGLang plugin's connector and a real agent"
"$venv/bin/python" scripts/gpu_check.py ipc
if "$venv/bin/python" -c 'import sglang.srt.plugins' 2>/dev/null; then
  echo "== One SGLang request through --radix-cache-backend flexkv-agent"
  "$venv/bin/python" scripts/gpu_check.py sglang
else
  echo "SKIP sglang part: sglang does not import in $venv (install sglang==0.5.23 into $PY)"
fi
echo "gpu_check: OK"
