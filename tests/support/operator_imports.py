"""What importing the whole operator loads, measured in a fresh interpreter.

The operator may import the contract package of ``node_agent`` (the names and
rules both sides agree on, docs/contracts.md section 7) and nothing else of it,
and never torch or zmq. :data:`PROBE` imports every ``flexkv_operator`` module
and prints the loaded module names as JSON; :func:`forbidden_modules` names what
should not be among them.
"""

from __future__ import annotations

import json

PROBE = (
    "import importlib, json, pkgutil, sys\n"
    "import flexkv_operator\n"
    "for info in pkgutil.walk_packages(flexkv_operator.__path__, 'flexkv_operator.'):\n"
    "    importlib.import_module(info.name)\n"
    "print(json.dumps(sorted(sys.modules)))\n"
)
CONTRACT = "node_agent.contract"


def forbidden_modules(probe_output: str) -> list[str]:
    """The modules in the output of :data:`PROBE` that importing the operator must not
    load: torch, zmq, and any ``node_agent`` module outside the contract package."""
    loaded: list[str] = json.loads(probe_output.strip().splitlines()[-1])
    bad = []
    for name in loaded:
        top = name.split(".")[0]
        if top in ("torch", "zmq") or (top == "node_agent" and name != "node_agent" and not (
            name == CONTRACT or name.startswith(CONTRACT + ".")
        )):
            bad.append(name)
    return bad


def loaded_contract_modules(probe_output: str) -> list[str]:
    """The ``node_agent`` modules the probe saw loaded (the contract, and its parent)."""
    loaded: list[str] = json.loads(probe_output.strip().splitlines()[-1])
    return [name for name in loaded if name.split(".")[0] == "node_agent"]
