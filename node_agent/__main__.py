"""``flexkv-agent`` / ``python -m node_agent``: ``run --config PATH`` or ``demo [options]``.

Exit codes: 0 on a clean stop (SIGTERM / SIGINT included), 2 for an invalid
configuration or command line (the message names the key, value and fix), 1 for
any other failure.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from node_agent.backend.lanes import PIN_VARIABLE, keep_lanes_apart
from node_agent.backend.remote.mooncake_client import MooncakeUnavailable
from node_agent.config import ConfigError, load_config
from node_agent.openmp import log_policy, sleep_idle_workers

_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    """``time level logger message key=value...``: structured ``extra`` fields appended."""

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = {k: v for k, v in record.__dict__.items() if k not in _STD_ATTRS}
        if not extras:
            return base
        return base + " " + " ".join(f"{k}={json.dumps(v, default=str)}"
                                     for k, v in sorted(extras.items()))


def setup_logging(level: str) -> None:
    """Log to stderr with structured fields."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _kube_api(mode: str) -> Any:
    """A ``kubernetes`` ApiClient, or None when Kubernetes is off (or absent under auto)."""
    if mode == "off" or (mode == "auto" and "KUBERNETES_SERVICE_HOST" not in os.environ):
        return None
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)  # before the heavy imports: bad configs fail fast
    if cfg.backend == "flexkv" and importlib.util.find_spec("flexkv") is None:
        raise ConfigError(
            "backend: 'flexkv' but the flexkv package is not importable in this agent; "
            "install FlexKV (see the README, 'Adding FlexKV to an agent') or set "
            "backend: embedded"
        )
    from node_agent.agent import Agent
    from node_agent.assembly import default_stage_builder

    apart = keep_lanes_apart(os.environ.get(PIN_VARIABLE, "1") != "0")
    logging.getLogger(__name__).info(
        "Copy lanes kept on separate CPUs where they are as many as the agent's CPUs"
        if apart else "Copy lanes not pinned", extra={"variable": PIN_VARIABLE})

    agent = Agent(cfg, default_stage_builder, kube_api=_kube_api(cfg.kubernetes),
                  config_path=args.config)
    server = agent.uvicorn_server()
    # uvicorn shuts down gracefully on SIGTERM, restores this handler and re-raises
    # the signal: the process then exits 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.getLogger("node_agent").info(
        "Agent starting", extra={"node": cfg.node_name, "pool": cfg.pool,
                                 "http": cfg.ports.http, "engine_socket": cfg.engine_socket})
    asyncio.run(server.serve())
    return 0 if server.started else 1


def build_parser() -> argparse.ArgumentParser:
    """The command line (``demo`` options come from :mod:`node_agent.demo.runner`)."""
    from node_agent.demo.runner import add_demo_arguments

    parser = argparse.ArgumentParser(
        prog="flexkv-agent",
        description="The flexkv node agent: serve a node's KV cache (run), or try it locally "
                    "(demo).")
    parser.add_argument("--log-level", default=os.environ.get("FLEXKV_LOG_LEVEL", "info"),
                        choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the node agent")
    run.add_argument("--config", required=True, help="path of agent.yaml")
    demo = sub.add_parser("demo", help="run the local demo: agents, a PP group, an engine load")
    add_demo_arguments(demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flexkv-agent``."""
    policy = sleep_idle_workers()  # before anything imports torch (node_agent.openmp)
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    log_policy(policy)
    try:
        if args.command == "run":
            return _run(args)
        from node_agent.demo.runner import run_demo

        return run_demo(args)
    except ConfigError as exc:
        print(f"flexkv-agent: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except MooncakeUnavailable as exc:
        print(f"flexkv-agent: the remote tier cannot start: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
