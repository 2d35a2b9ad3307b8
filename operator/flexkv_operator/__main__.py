"""``flexkv-operator`` / ``python -m flexkv_operator``: run the operator."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys

from flexkv_operator.app import discover_connection, run_operator
from flexkv_operator.context import OperatorSettings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="flexkv-operator", description="Reconcile KVCachePools into FlexKV node agents"
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        dest="namespaces",
        help="Namespace to serve (repeatable)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="Serve every namespace")
    parser.add_argument(
        "--liveness-port", type=int, default=8081, help="Port of the /healthz endpoint (0 disables)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        help="Port of the operator's GET /metrics and GET /readyz (0 disables)",
    )
    parser.add_argument("--verbose", action="store_true", help="Debug logging")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    connection, login = discover_connection()
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    asyncio.run(
        run_operator(
            connection=connection,
            login=login,
            settings=dataclasses.replace(
                OperatorSettings.from_env(), metrics_port=args.metrics_port
            ),
            namespaces=args.namespaces or (),
            clusterwide=bool(args.all_namespaces),
            liveness_endpoint=liveness,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
