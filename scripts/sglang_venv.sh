#!/usr/bin/env bash
# Throwaway venv for the SGLang plugin's import-level test (tests/sglang/test_sglang_loader.py):
# .venv-sglang holds sglang==0.5.23 installed WITHOUT its dependencies (its CUDA
# stack cannot be installed here), msgspec (the one extra module SGLang's runtime
# context imports on the way to its radix-cache registry), and this project
# (editable, --no-deps). torch, numpy and pyzmq come from .venv through a .pth
# file instead of a second copy. .venv itself never sees sglang.
# Idempotent: cached by a stamp of this script and pyproject.toml, like .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION="0.5.23"
MSGSPEC_VERSION="0.23.0"
venv=.venv-sglang
stamp=$venv/.installed-$(cat pyproject.toml scripts/sglang_venv.sh | sha1sum | cut -c1-12)
[ -f "$stamp" ] && exit 0

[ -x .venv/bin/python ] || bash scripts/bootstrap.sh
base_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$venv"
python3 -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base_site" > "$site/zz-flexkv-base-venv.pth"
pip_q=(-q --disable-pip-version-check)
"$venv/bin/python" -m pip install "${pip_q[@]}" --no-deps \
  "sglang==${SGLANG_VERSION}" "msgspec==${MSGSPEC_VERSION}"
"$venv/bin/python" -m pip install "${pip_q[@]}" --no-deps -e .
touch "$stamp"
