"""The agent pod's rendered privileges, run for real on this kernel.

The operator's rendering of a pool is taken apart into what the kubelet and the
container runtime would do: host directories created ``root:root 0755`` (as
``DirectoryOrCreate`` does), the init container's exact command run as root with
the capability bounding set its securityContext leaves (only CHOWN), and the agent
run as the rendered UID/GID with no capabilities, binding a Unix socket (what its
``ipc://`` engine socket is) and creating files in every directory. The host
paths are re-rooted under a temporary directory; nothing else changes.

Needs root and util-linux ``setpriv`` (skipped otherwise).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flexkv_operator import children
from flexkv_operator.children import PoolIdentity
from flexkv_operator.spec import parse_pool_spec

OWNER = {"apiVersion": "flexkv.io/v1alpha1", "kind": "KVCachePool", "name": "p", "uid": "u1",
         "controller": True, "blockOwnerDeletion": True}
POOL = PoolIdentity("p", "ns", OWNER)
TIMEOUT_S = 20

# What the agent does in each directory: bind a Unix socket and create a file.
PROBE = """
import socket, sys
for d in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(d + "/probe.sock")
        open(d + "/probe.bin", "wb").close()
    except PermissionError as exc:
        sys.exit(f"cannot write {d}: {exc}")
    finally:
        s.close()
"""

SETPRIV = shutil.which("setpriv")
pytestmark = pytest.mark.skipif(
    os.name != "posix" or os.geteuid() != 0 or SETPRIV is None,
    reason="needs root and util-linux setpriv to run the pod's users and capabilities",
)


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False)


def _as_agent(context: dict[str, Any], argv: list[str]) -> list[str]:
    """argv run as the agent container would be: its user, no capabilities."""
    assert context["capabilities"] == {"drop": ["ALL"]}
    return [str(SETPRIV), f"--reuid={context['runAsUser']}", f"--regid={context['runAsGroup']}",
            "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", *argv]


def _as_init(context: dict[str, Any], argv: list[str]) -> list[str]:
    """argv run as the init container would be: root, bounded to the added capabilities."""
    assert context["runAsUser"] == 0 and context["capabilities"]["drop"] == ["ALL"]
    caps = ",".join(["-all", *(f"+{c.lower()}" for c in context["capabilities"]["add"])])
    return [str(SETPRIV), "--inh-caps=-all", f"--bounding-set={caps}", "--no-new-privs", *argv]


@pytest.fixture
def node() -> Iterator[Path]:
    """A stand-in for the node's filesystem root, traversable by any user."""
    root = Path(tempfile.mkdtemp(prefix="flexkv-node-"))
    try:
        root.chmod(0o755)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _python_for(context: dict[str, Any], node: Path) -> str:
    """An interpreter the agent's user may execute (the test venv may live under /root)."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if candidate and _run(_as_agent(context, [candidate, "-c", "pass"]), node).returncode == 0:
            return candidate
    pytest.skip("no Python interpreter is executable by the agent's user")


def _pod(spec_extra: dict[str, Any]) -> dict[str, Any]:
    spec = {"tiers": {"cpu": {"size": 1}, "ssd": {"size": 1, "paths": [
        "/mnt/nvme0/flexkv", "/mnt/odd;touch pwned"]}}, **spec_extra}
    config = parse_pool_spec(spec, "img:1")
    pod: dict[str, Any] = children.render_daemon_set(POOL, config, "sa")["spec"]["template"][
        "spec"]
    return pod


@pytest.mark.parametrize("ids", [None, (23456, 34567)])
def test_init_container_makes_every_host_directory_the_agents(
    node: Path, ids: tuple[int, int] | None,
) -> None:
    extra = {} if ids is None else {
        "agent": {"securityContext": {"runAsUser": ids[0], "runAsGroup": ids[1]}}}
    pod = _pod(extra)
    (init,) = pod["initContainers"]
    (agent,) = pod["containers"]
    context = agent["securityContext"]
    chown, end, owner, *paths = init["command"]
    assert (chown, end) == ("chown", "--")
    # Re-root the container paths on the stand-in node, created as the kubelet does.
    dirs = [node / p.lstrip("/") for p in paths]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        for p in (d, *d.parents):
            if p == node:
                break
            p.chmod(0o755)
    python = _python_for(context, node)
    probe = [python, "-c", PROBE, *map(str, dirs)]

    before = _run(_as_agent(context, probe), node)
    assert before.returncode != 0 and "cannot write" in before.stderr, before

    # Without CHOWN the init container could not do its job: the capability is needed.
    no_caps = {**init["securityContext"], "capabilities": {"drop": ["ALL"], "add": []}}
    denied = _run(_as_init(no_caps, [chown, end, owner, *map(str, dirs)]), node)
    assert denied.returncode != 0 and "Operation not permitted" in denied.stderr, denied

    for _ in range(2):  # a restarted pod runs it again on directories it already owns
        done = _run(_as_init(init["securityContext"], [chown, end, owner, *map(str, dirs)]), node)
        assert done.returncode == 0, done.stderr
    uid, gid = context["runAsUser"], context["runAsGroup"]
    assert owner == f"{uid}:{gid}"
    for d in dirs:
        st = d.stat()
        assert (st.st_uid, st.st_gid) == (uid, gid), d
    assert not (node / "pwned").exists() and not Path("pwned").exists()

    after = _run(_as_agent(context, probe), node)
    assert after.returncode == 0, after.stderr
    assert all((d / "probe.sock").is_socket() for d in dirs)
