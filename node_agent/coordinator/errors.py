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

