"""OpenMP's idle workers in the agent process: asleep, not spinning.

torch runs large CPU operations on OpenMP worker threads (one per core by
default). When such an operation ends, GNU libgomp, the runtime of torch's
Linux wheels, keeps its workers spinning for a while before they sleep (about
8 ms on a 2-core AMD EPYC development machine, measured as the process's CPU
time while its main thread slept). The agent shares its node's cores with the
engines it serves: every torch operation it ran would leave those workers
burning cores that the engines' processes and the agent's own copy lanes (which
copy without OpenMP, :mod:`node_agent.backend.lanes`) need next.

:func:`sleep_idle_workers` sets ``OMP_WAIT_POLICY=PASSIVE`` (the OpenMP
standard's setting, read by libgomp and LLVM/Intel runtimes alike) before torch
loads its runtime, unless the environment already names a policy: an operator's
own ``OMP_WAIT_POLICY`` wins. The runtime reads the variable once, when it
loads, so this must run before anything imports torch; ``flexkv-agent`` calls it
first thing. Child processes inherit the setting.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

POLICY_VARIABLE = "OMP_WAIT_POLICY"
"""The environment variable the OpenMP runtime reads its idle workers' policy from."""


def sleep_idle_workers(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Make this process's OpenMP workers sleep when idle; returns the policy in
    force: ``PASSIVE`` when set here, else the value the environment already held.
    None when torch was imported before this call (of ``os.environ``): the
    runtime has already read its settings, so the variable is left alone;
    :func:`log_policy` then says so."""
    env = os.environ if environ is None else environ
    given = env.get(POLICY_VARIABLE)
    if given:
        return given
    if environ is None and "torch" in sys.modules:
        return None
    env[POLICY_VARIABLE] = "PASSIVE"
    return "PASSIVE"


def log_policy(policy: str | None) -> None:
    """Log what :func:`sleep_idle_workers` returned (a warning when it came too late)."""
    if policy is None:
        log.warning("OpenMP idle workers keep spinning: torch was imported before the "
                    "agent could set their wait policy; set OMP_WAIT_POLICY=PASSIVE in the "
                    "agent's environment", extra={"variable": POLICY_VARIABLE})
    else:
        log.debug("OpenMP wait policy", extra={"policy": policy})
