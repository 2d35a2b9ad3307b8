"""Configuration of one stage's connector (one PP group member)."""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.vocab.layout import KVLayout


@dataclass(frozen=True)
class CoordinatorConfig:
    """What a connector needs besides its backend, store, keys and view.

    ``fanout_endpoint`` is where this stage's fan-out server binds (the
    ``ports.fanout`` of agent.yaml as ``tcp://<ip>:<port>``; port 0 picks a free
    one); None for a group of one stage. Timeouts follow agent.yaml
    ``timeouts``: ``engine_call_seconds`` bounds every engine-facing call,
    ``fanout_wait_seconds`` a follower's wait for the leader's decision and the
    leader's wait for followers' acks, ``transfer_seconds`` one stage's copy.
    The longest chain of waits in one engine call is ``fanout_wait_seconds +
    3 * transfer_seconds`` and must stay below ``engine_call_seconds``
    (``node_agent.vocab.budget.call_budget`` computes such a split; the
    defaults are its split of 10 s).
    """

    group: str
    pp_rank: int
    layout: KVLayout
    fanout_endpoint: str | None = None
    engine_call_seconds: float = 10.0
    fanout_wait_seconds: float = 4.5
    transfer_seconds: float = 1.5
    heartbeat_seconds: float = 0.1
    leader_timeout_seconds: float = 3.0
    expected_ranks: int = 1
    max_pending: int = 4096
    max_completed: int = 65536

    def __post_init__(self) -> None:
        if not self.group:
            raise ValueError("CoordinatorConfig.group is empty; set it to the KVCacheGroup name")
        if isinstance(self.pp_rank, bool) or not isinstance(self.pp_rank, int) or self.pp_rank < 0:
            raise ValueError(f"CoordinatorConfig.pp_rank={self.pp_rank!r} must be an int >= 0")
        for key in ("engine_call_seconds", "fanout_wait_seconds", "transfer_seconds",
                    "heartbeat_seconds", "leader_timeout_seconds"):
            v = getattr(self, key)
            if not isinstance(v, int | float) or v <= 0:
                raise ValueError(
                    f"CoordinatorConfig.{key}={v!r} must be a positive number of seconds"
                )
        for key in ("max_pending", "max_completed"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"CoordinatorConfig.{key}={v!r} must be an int >= 1")
        chain = self.fanout_wait_seconds + 3 * self.transfer_seconds
        if chain >= self.engine_call_seconds:
            raise ValueError(
                f"CoordinatorConfig: fanout_wait_seconds={self.fanout_wait_seconds:g} + 3 x "
                f"transfer_seconds={self.transfer_seconds:g} = {chain:g} must be below "
                f"engine_call_seconds={self.engine_call_seconds:g} (the longest chain of "
                "waits in one engine call); derive both from engine_call_seconds with "
                "node_agent.vocab.budget.call_budget"
            )
        if self.heartbeat_seconds * 3 > self.leader_timeout_seconds:
            raise ValueError(
                "CoordinatorConfig.leader_timeout_seconds="
                f"{self.leader_timeout_seconds} must be at least 3x "
                f"heartbeat_seconds={self.heartbeat_seconds}"
            )

    @property
    def tokens_per_block(self) -> int:
        """Page size: stores are aligned down to whole blocks."""
        return self.layout.tokens_per_block

    @property
    def whole_pages(self) -> int | None:
        """The page size when the layout is copied by whole pages only
        (``layer_block_head_token_kv``): then every store's and retrieve's slots
        must be whole, aligned pages. None for the other layouts."""
        return self.layout.tokens_per_block if self.layout.name.paged else None
