"""Each console script runs from a virtual environment that holds only its own
extra: ``.venvs/agent`` (torch CPU + ``.[agent]``) and ``.venvs/operator``
(``.[operator]``), made and cached by scripts/extras_venvs.sh.

These venvs are the proof that runtime code imports nothing from the ``dev``
extra (the main .venv has every extra, so it cannot show that).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.operator_imports import (
    CONTRACT,
    PROBE,
    forbidden_modules,
    loaded_contract_modules,
)

REPO = Path(__file__).resolve().parents[1]
VENVS = REPO / ".venvs"
INSTALL_TIMEOUT_S = 1500
READY_TIMEOUT_S = 90


def _venv(extra: str) -> Path:
    """Make (or reuse) the venv of ``extra``; failing to make it fails the test."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / "extras_venvs.sh"), extra],
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"scripts/extras_venvs.sh {extra}:\n{proc.stderr[-4000:]}"
    return VENVS / extra


@pytest.fixture(scope="module")
def agent_venv() -> Path:
    return _venv("agent")


@pytest.fixture(scope="module")
def operator_venv() -> Path:
    return _venv("operator")


@pytest.fixture()
def work() -> Iterator[Path]:
    # Short: the engine socket path must fit a Unix socket address.
    d = Path(f"/tmp/fkv-extras-{os.getpid()}-{time.monotonic_ns() % 10**9}")
    d.mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run(
    venv: Path, *cmd: str, cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a command of ``venv`` outside the repository (no source tree on sys.path)."""
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run([str(venv / "bin" / cmd[0]), *cmd[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _importable(venv: Path, module: str, cwd: Path) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return _run(venv, "python", "-c", code, cwd=cwd).returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 300)
def test_operator_venv_holds_only_its_extra_and_its_command_runs(
    operator_venv: Path, work: Path
) -> None:
    for absent in ("torch", "numpy", "kubernetes", "zmq", "fastapi", "httpx", "pytest"):
        assert not _importable(operator_venv, absent, work), f"{absent} in .venvs/operator"
    assert _importable(operator_venv, "kopf", work)
    out = _run(operator_venv, "flexkv-operator", "--help", cwd=work)
    assert out.returncode == 0, out.stderr
    assert "usage: flexkv-operator" in out.stdout
    bad = _run(operator_venv, "flexkv-operator", "-A", "--no-such-flag", cwd=work)
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr
    # Its extra suffices for every operator module, which loads of node_agent only
    # the contract package (the names both sides agree on).
    probe = _run(operator_venv, "python", "-c", PROBE, cwd=work)
    assert probe.returncode == 0, probe.stderr
    assert forbidden_modules(probe.stdout) == []
    assert f"{CONTRACT}.kube" in loaded_contract_modules(probe.stdout)


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 300)
def test_agent_venv_holds_only_its_extra_and_help_works(agent_venv: Path, work: Path) -> None:
    for absent in ("kopf", "httpx", "pytest", "hypothesis", "jsonschema"):
        assert not _importable(agent_venv, absent, work), f"{absent} in .venvs/agent"
    for present in ("torch", "zmq", "uvicorn"):
        assert _importable(agent_venv, present, work)
    for args in (("--help",), ("run", "--help"), ("demo", "--help")):
        out = _run(agent_venv, "flexkv-agent", *args, cwd=work)
        assert out.returncode == 0, f"flexkv-agent {' '.join(args)}: {out.stderr}"
        assert "usage: flexkv-agent" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 300)
def test_agent_run_serves_readyz_from_its_own_venv(agent_venv: Path, work: Path) -> None:
    port = _free_port()
    config = work / "agent.yaml"
    config.write_text(yaml.safe_dump({
        "pool": "sample", "namespace": "default", "backend": "embedded",
        "tokensPerBlock": 16, "tiers": {"cpu": {"size": "4Mi", "pinned": False}},
        "ports": {"http": port, "fanout": _free_port()},
        "engineSocket": str(work / "engine.sock"), "curveKeyDir": str(work / "curve"),
        "expectedRanks": 1, "nodeName": "node-a", "advertiseAddress": "127.0.0.1",
        "bindAddress": "127.0.0.1", "kubernetes": "off",
    }))
    env = {"PATH": f"{agent_venv / 'bin'}:/usr/bin:/bin", "HOME": str(work)}
    log = (work / "agent.log").open("w+")
    proc = subprocess.Popen([str(agent_venv / "bin" / "flexkv-agent"), "run", "--config",
                             str(config)], cwd=work, env=env, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    try:
        status = None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while status is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                    status = r.status
            except urllib.error.HTTPError as exc:
                status = exc.code  # answered, e.g. 503 before any engine rank registered
            except OSError:
                time.sleep(0.2)
        log.seek(0)
        assert status in (200, 503), f"/readyz never answered (exit {proc.poll()}):\n{log.read()}"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(timeout=30)
        log.close()
    assert code == 0, (work / "agent.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 300)
def test_agent_run_with_bad_config_exits_2_naming_the_key(agent_venv: Path, work: Path) -> None:
    config = work / "bad.yaml"
    config.write_text("tiers:\n  cpu:\n    size: 8GB\n")
    out = _run(agent_venv, "flexkv-agent", "run", "--config", str(config), cwd=work)
    assert out.returncode == 2, out.stderr
    assert "tiers.cpu.size: '8GB' has unknown suffix 'GB'" in out.stderr


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 300)
def test_agent_demo_runs_from_its_own_venv(agent_venv: Path, work: Path) -> None:
    out = _run(agent_venv, "flexkv-agent", "demo", "--conversations", "2", "--turns", "2",
               "--system-tokens", "32", "--user-tokens", "16", "--reply-tokens", "16",
               "--layers", "2", "--kv-heads", "2", "--head-size", "16", "--cpu-size", "4Mi",
               "--timeout", "120", cwd=work, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all bit-exact" in out.stdout
