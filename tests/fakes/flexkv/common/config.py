"""Fake of ``flexkv/common/config.py``: ``ModelConfig``, ``CacheConfig`` and the env config.

Field names, defaults and types follow FlexKV (commit 34ab141, "replace is_mla
with kv_dim"): there is no ``use_mla`` any more, ``kv_dim`` is 2 for K and V or
1 for MLA, ``dtype`` is a ``torch.dtype``, cache capacity is given in blocks
(``num_cpu_blocks``, ``num_ssd_blocks``). Unknown field names raise
``TypeError`` (dataclass constructor), wrong types raise ``TypeError``.
"""

from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass

import torch

from flexkv._checks import check_bool, check_int, check_str

_VALID_EVICTION_POLICIES = {"lru", "lfu", "slru", "fifo", "mru", "filo"}


@dataclass
class ModelConfig:
    num_layers: int = 1
    num_kv_heads: int = 1
    head_size: int = 1
    kv_dim: int = 2
    dtype: torch.dtype = torch.bfloat16
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    cp_size: int = 1
    nnodes: int = 1
    instance_num: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "tp_size", "pp_size",
                     "dp_size", "cp_size", "nnodes", "instance_num"):
            check_int(f"ModelConfig.{name}", getattr(self, name), minimum=1)
        check_int("ModelConfig.kv_dim", self.kv_dim)
        if self.kv_dim not in (1, 2):
            raise AssertionError(
                f"fake flexkv: ModelConfig.kv_dim must be 2 (K and V) or 1 (MLA), got {self.kv_dim}"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"fake flexkv: ModelConfig.dtype must be a torch.dtype, got {self.dtype!r}"
            )
        if self.kv_dim == 1 and self.num_kv_heads != 1:
            raise AssertionError(
                "fake flexkv: MLA (kv_dim=1) has one latent head, "
                f"got num_kv_heads={self.num_kv_heads}"
            )
        if self.num_kv_heads > 1 and self.num_kv_heads % self.tp_size != 0:
            raise AssertionError(
                f"fake flexkv: num_kv_heads={self.num_kv_heads} is the whole model's count "
                f"and must divide evenly over tp_size={self.tp_size}"
            )

    @property
    def total_gpus(self) -> int:
        """GPU registrations one instance waits for: dp x tp x cp x pp."""
        return self.dp_size * self.tp_size * self.cp_size * self.pp_size

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.num_kv_heads * self.head_size * self.kv_dim * self.dtype.itemsize


@dataclass
class CacheConfig:
    tokens_per_block: int = 16
    eviction_policy: str = "lru"
    enable_cpu: bool = True
    enable_ssd: bool = False
    enable_gds: bool = False
    enable_remote: bool = False
    num_cpu_blocks: int = 1000000
    num_ssd_blocks: int = 10000000
    ssd_cache_dir: str | list[str] | None = None

    def __post_init__(self) -> None:
        check_int("CacheConfig.tokens_per_block", self.tokens_per_block, minimum=1)
        check_str("CacheConfig.eviction_policy", self.eviction_policy)
        if self.eviction_policy not in _VALID_EVICTION_POLICIES:
            raise AssertionError(
                f"fake flexkv: eviction_policy {self.eviction_policy!r} is not one of "
                f"{sorted(_VALID_EVICTION_POLICIES)}"
            )
        for name in ("enable_cpu", "enable_ssd", "enable_gds", "enable_remote"):
            check_bool(f"CacheConfig.{name}", getattr(self, name))
        if not self.enable_cpu:
            raise AssertionError("fake flexkv: enable_cpu must be True (KVTaskManager requires it)")
        check_int("CacheConfig.num_cpu_blocks", self.num_cpu_blocks, minimum=1)
        check_int("CacheConfig.num_ssd_blocks", self.num_ssd_blocks, minimum=0)
        if self.enable_ssd:
            dirs = self.ssd_cache_dir
            if isinstance(dirs, str):
                dirs = [dirs]
            if not dirs or not all(type(d) is str and d for d in dirs):
                raise AssertionError(
                    f"fake flexkv: enable_ssd needs ssd_cache_dir (str or list of str), "
                    f"got {self.ssd_cache_dir!r}"
                )
            if self.num_ssd_blocks < 1 or self.num_ssd_blocks % len(dirs) != 0:
                raise AssertionError(
                    f"fake flexkv: num_ssd_blocks ({self.num_ssd_blocks}) must be a positive "
                    f"multiple of the number of SSD dirs ({len(dirs)}) (storage/allocator.py)"
                )


#: FlexKV reads these from FLEXKV_* environment variables at import time; the
#: cache engine takes eviction settings from here, not from CacheConfig.
GLOBAL_CONFIG_FROM_ENV: Namespace = Namespace(
    server_client_mode=False,
    server_recv_port="ipc:///tmp/flexkv_server",
    evict_ratio=0.0,
    evict_start_threshold=1.0,
    eviction_policy="lru",
    enable_mps=True,
)
