"""Fake of ``flexkv/common/storage.py``: ``KVCacheLayoutType`` and ``KVCacheLayout``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from flexkv._checks import check_int


class KVCacheLayoutType(Enum):
    LAYERFIRST = "LAYERFIRST"
    BLOCKFIRST = "BLOCKFIRST"
    LAYERBLOCK = "LAYERBLOCK"


@dataclass
class KVCacheLayout:
    """Shape of one rank's GPU KV cache as FlexKV sees it (``num_head``: this rank's heads)."""

    type: KVCacheLayoutType
    num_layer: int
    num_block: int
    tokens_per_block: int
    num_head: int
    head_size: int
    kv_dim: int = 2
    num_kv_heads: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.type, KVCacheLayoutType):
            raise TypeError(
                "fake flexkv: KVCacheLayout.type must be "
                f"KVCacheLayoutType, got {self.type!r}"
            )
        for name in ("num_layer", "num_block", "tokens_per_block", "num_head", "head_size",
                     "num_kv_heads"):
            check_int(f"KVCacheLayout.{name}", getattr(self, name), minimum=1)
        check_int("KVCacheLayout.kv_dim", self.kv_dim)
        if self.kv_dim not in (1, 2):
            raise AssertionError(
                "fake flexkv: KVCacheLayout.kv_dim must be "
                f"1 or 2, got {self.kv_dim}"
            )
