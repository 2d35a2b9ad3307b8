"""Fake of ``flexkv/server/client.py``: ``KVTPClient``, one engine rank's GPU registration.

Real FlexKV sends CUDA IPC handles of the rank's KV tensors over ZMQ to the
transfer manager listening on ``gpu_register_port``; the fake hands the tensors
to the started fake ``KVManager`` bound to that port, which checks them against
its ModelConfig and CacheConfig.
"""

from __future__ import annotations

from typing import Any

import torch

from flexkv import _fake
from flexkv._checks import check_int, check_str
from flexkv.common.storage import KVCacheLayout


class KVTPClient:
    def __init__(self, gpu_register_port: str, dp_client_id: int, device_id: int,
                 pp_rank: int = 0, intra_client_id: int = 0) -> None:
        check_str("gpu_register_port", gpu_register_port)
        if not gpu_register_port:
            raise AssertionError("fake flexkv: gpu_register_port is empty")
        check_int("dp_client_id", dp_client_id, minimum=0)
        check_int("device_id", device_id, minimum=0)
        check_int("pp_rank", pp_rank, minimum=0)
        check_int("intra_client_id", intra_client_id, minimum=0)
        self.gpu_register_port = gpu_register_port
        self.dp_client_id = dp_client_id
        self.device_id = device_id
        self.pp_rank = pp_rank
        self.intra_client_id = intra_client_id

    def register_to_server(self, kv_caches: list[torch.Tensor], kv_layout: KVCacheLayout,
                           override_device_id: int | None = None, **kwargs: Any) -> None:
        if kwargs:
            raise AssertionError(
                "fake flexkv: multi-group/SWA registration not "
                f"modelled: {sorted(kwargs)}"
            )
        tensors_ok = all(isinstance(t, torch.Tensor) for t in kv_caches or [])
        if not isinstance(kv_caches, list) or not tensors_ok:
            raise TypeError("fake flexkv: kv_caches must be a list of torch.Tensor")
        if not kv_caches or (_fake.Knobs.require_cuda and not kv_caches[0].is_cuda):
            raise ValueError("GPU blocks must be CUDA tensors")
        if not isinstance(kv_layout, KVCacheLayout):
            raise TypeError(
                "fake flexkv: kv_layout must be KVCacheLayout, "
                f"got {type(kv_layout).__name__}"
            )
        manager = _fake.BY_REGISTER_PORT.get(self.gpu_register_port)
        if manager is None:
            raise AssertionError(
                f"fake flexkv: no started KVManager listens on {self.gpu_register_port!r}; "
                "registration would never be received"
            )
        manager._register((self.dp_client_id, self.intra_client_id), self.pp_rank,
                          kv_caches, kv_layout)
