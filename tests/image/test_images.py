"""The built images run: non-root, each command from its own image, and a bad
agent configuration ends with exit 2 and a clear message.

The images are built by scripts/image_test.sh (``make image-test``), which sets
FLEXKV_OPERATOR_IMAGE and FLEXKV_AGENT_IMAGE_UNDER_TEST to their local tags;
without them (``make test``) these checks skip and say where they run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator

import pytest

OPERATOR = os.environ.get("FLEXKV_OPERATOR_IMAGE", "")
AGENT = os.environ.get("FLEXKV_AGENT_IMAGE_UNDER_TEST", "")
DRIVER = os.environ.get("BUILDAH_STORAGE_DRIVER", "vfs")
OPERATOR_MAX_MB = 300
IMAGE_USER = "10001"

pytestmark = pytest.mark.skipif(
    not (OPERATOR and AGENT and shutil.which("buildah")),
    reason="images are built and checked by `make image-test` (scripts/image_test.sh)")


def _buildah(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", "--storage-driver", DRIVER, *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def _container(image: str) -> Iterator[str]:
    made = _buildah("from", "--pull=never", image)
    assert made.returncode == 0, made.stderr
    name = made.stdout.strip()
    yield name
    _buildah("rm", name)


@pytest.fixture(scope="module")
def operator_ctr() -> Iterator[str]:
    yield from _container(OPERATOR)


@pytest.fixture(scope="module")
def agent_ctr() -> Iterator[str]:
    yield from _container(AGENT)


def _run(ctr: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in ``ctr`` as the image's user (buildah run honours USER)."""
    return _buildah("run", "--isolation", "chroot", ctr, "--", *cmd)


def _size_mb(image: str) -> float:
    out = _buildah("images", "--noheading", "--format", "{{.Size}}", image)
    m = re.fullmatch(r"([\d.]+)\s*([kMG]B)", out.stdout.strip())
    assert m, f"unexpected size {out.stdout!r} of {image}"
    return float(m.group(1)) * {"kB": 1e-3, "MB": 1.0, "GB": 1e3}[m.group(2)]


@pytest.mark.parametrize("which", ["operator", "agent"])
def test_runs_as_the_numeric_non_root_user(which: str, request: pytest.FixtureRequest) -> None:
    ctr = request.getfixturevalue(f"{which}_ctr")
    out = _run(ctr, "id", "-u")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == IMAGE_USER


def test_operator_image_runs_its_command_and_has_no_torch(operator_ctr: str) -> None:
    out = _run(operator_ctr, "flexkv-operator", "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: flexkv-operator" in out.stdout
    for absent in ("torch", "zmq", "fastapi"):
        probe = _run(operator_ctr, "python3", "-c", f"import {absent}")
        assert probe.returncode != 0, f"{absent} is importable in the operator image"
    assert _run(operator_ctr, "python3", "-c", "import kopf").returncode == 0


def test_operator_image_is_at_most_300_mb() -> None:
    assert _size_mb(OPERATOR) <= OPERATOR_MAX_MB


def test_agent_image_runs_its_command_with_cpu_torch(agent_ctr: str) -> None:
    out = _run(agent_ctr, "flexkv-agent", "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: flexkv-agent" in out.stdout
    torch = _run(agent_ctr, "python3", "-c",
                 "import torch; print(torch.__version__, torch.version.cuda)")
    assert torch.returncode == 0, torch.stderr
    version, cuda = torch.stdout.split()
    assert cuda == "None", f"agent image carries a CUDA torch build {version}"
    assert _run(agent_ctr, "python3", "-c", "import kopf").returncode != 0


def test_agent_image_carries_mooncake_for_the_remote_tier(agent_ctr: str) -> None:
    """The remote extra and libibverbs1 are in the agent image: the client imports and
    the managed master's binary runs (KVCachePool spec.tiers.remote.mooncake.managed)."""
    out = _run(agent_ctr, "mooncake_master", "--version")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mooncake_master version 0.3.13" in out.stdout + out.stderr
    probe = _run(agent_ctr, "python3", "-c", "import mooncake.store")
    assert probe.returncode == 0, probe.stderr


def test_agent_with_bad_config_exits_2_naming_the_key(agent_ctr: str) -> None:
    out = _run(agent_ctr, "sh", "-c",
               "printf 'tiers:\\n  cpu:\\n    size: 8GB\\n' > /tmp/bad.yaml && "
               "flexkv-agent run --config /tmp/bad.yaml")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "invalid configuration" in out.stderr
    assert "tiers.cpu.size: '8GB' has unknown suffix 'GB'" in out.stderr


def test_agent_with_missing_config_exits_2_naming_the_path(agent_ctr: str) -> None:
    out = _run(agent_ctr, "flexkv-agent", "run", "--config", "/etc/flexkv/agent.yaml")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "/etc/flexkv/agent.yaml" in out.stderr and "--config" in out.stderr
