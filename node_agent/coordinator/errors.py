"""Errors the connector raises to the engine."""

from __future__ import annotations


class UnknownRequestError(KeyError):
    """An engine call named a request id the connector has no state for."""

    def __init__(self, rid: str, op: str, fix: str) -> None:
        super().__init__(rid)
        self.rid = rid
        self.message = f"{op}: unknown request id {rid!r}; {fix}"

    def __str__(self) -> str:
        return self.message



class SlotsStillWrittenError(RuntimeError):
    """A ``retrieve``'s load copy did not stop after its timeout and abort (a hung
    device): it may still write the engine's slots at any later time.

    Not a miss: a miss (0) tells the engine its slots are free to recompute into
    or reuse. The engine must keep these slots out of use (fail or hold the
    request, never recompute into them or hand them to another request) until
    the agent restarts. Sent to the engine as error type ``SlotsInUse``
    (:attr:`wire_type`); docs/agent.md "Call deadlines"."""

    wire_type = "SlotsInUse"

    def __init__(self, rid: str, where: str, detail: str) -> None:
        self.rid = rid
        super().__init__(
            f"retrieve {rid!r}: the load copy on {where} did not stop after its timeout "
            f"and abort and may still write the request's slots ({detail}); keep those "
            "slots out of use (fail or hold the request, never recompute into them) "
            "until the agent restarts, and look for a hung device")
