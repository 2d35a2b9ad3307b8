"""How one ``engineCallSeconds`` is split among the connector's own waits.

Invariant 5 asks that the engine's answer is final: once the engine API has
answered a call (success, failure or timeout), that call must not write the
engine's slots (retrieve) or read them (store_kv) any more. The server cannot
stop a worker thread, so the connector's waits themselves must end first.

The longest chain of bounded waits in one connector call (node_agent/coordinator,
read from its code) is a follower's ``retrieve``: its copy waits for the stage's
copy lock (``transfer``) and copies (``transfer``), then waits for the leader's
verdict (``fanoutWait + transfer``). Every other call waits less: a leader's
``retrieve`` waits ``fanoutWait + transfer`` for acks, then launches and waits
``transfer``; a follower's ``store_kv`` waits ``fanoutWait`` for the decision,
then ``transfer`` twice. So with

    margin   = max(0.1 x engineCallSeconds, 0.05 s)
    budget   = engineCallSeconds - margin
    fanout   = min(fanoutWaitSeconds, budget / 2)
    transfer = (budget - fanout) / 3

the worst case ``fanout + 3 x transfer`` equals ``budget``, below
``engineCallSeconds`` by ``margin``. The engine API server's own timeout is a
last resort at ``engineCallSeconds + margin``: reaching it means a wait outside
this accounting (a lock, a stuck backend) and is logged as an internal error.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_MARGIN_SECONDS = 0.05
MARGIN_FRACTION = 0.1


@dataclass(frozen=True)
class CallBudget:
    """The connector's derived limits for one ``engineCallSeconds``."""

    engine_call_seconds: float
    margin_seconds: float
    fanout_wait_seconds: float
    transfer_seconds: float

    @property
    def worst_case_seconds(self) -> float:
        """The longest chain of connector waits in one engine call."""
        return self.fanout_wait_seconds + 3 * self.transfer_seconds

    @property
    def server_timeout_seconds(self) -> float:
        """The engine API server's last-resort bound on one call."""
        return self.engine_call_seconds + self.margin_seconds


def call_budget(engine_call_seconds: float, fanout_wait_seconds: float) -> CallBudget:
    """Split ``engine_call_seconds`` (module docstring); ``ValueError`` when
    ``fanout_wait_seconds`` is not below it."""
    if not 0 < fanout_wait_seconds < engine_call_seconds:
        raise ValueError(
            f"timeouts.fanoutWaitSeconds {fanout_wait_seconds:g} must be > 0 and below "
            f"timeouts.engineCallSeconds {engine_call_seconds:g}; use about half of it"
        )
    margin = max(MARGIN_FRACTION * engine_call_seconds, MIN_MARGIN_SECONDS)
    budget = engine_call_seconds - margin
    if budget <= 0:
        raise ValueError(
            f"timeouts.engineCallSeconds {engine_call_seconds:g} leaves no time after the "
            f"{margin:g}s margin; use at least {4 * MIN_MARGIN_SECONDS:g}"
        )
    fanout = min(fanout_wait_seconds, budget / 2)
    return CallBudget(engine_call_seconds=engine_call_seconds, margin_seconds=margin,
                      fanout_wait_seconds=fanout, transfer_seconds=(budget - fanout) / 3)
