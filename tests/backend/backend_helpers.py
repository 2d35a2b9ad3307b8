"""Shared builders for backend tests: layouts, engine buffers, round-trip helpers."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from node_agent.backend.config import EmbeddedBackendConfig
from node_agent.backend.embedded import EmbeddedBackend
from node_agent.vocab.layout import KVDtype, KVLayout, LayoutName

TPB = 4


def small_layout(
    kv_dim: int = 2,
    dtype: KVDtype = KVDtype.BFLOAT16,
    tp_size: int = 1,
    name: LayoutName = LayoutName.LAYER_SLOT_HEAD,
    tokens_per_block: int = TPB,
) -> KVLayout:
    """A tiny stage: 3 layers, 2 heads (per rank) of 8, or a 1x16 MLA latent."""
    if kv_dim == 1:
        return KVLayout(num_layers=3, num_kv_heads=1, head_size=16, kv_dim=1, dtype=dtype,
                        tokens_per_block=tokens_per_block, tp_size=tp_size, name=name)
    return KVLayout(num_layers=3, num_kv_heads=2 * tp_size, head_size=8, kv_dim=2, dtype=dtype,
                    tokens_per_block=tokens_per_block, tp_size=tp_size, name=name)


def make_buffers(layout: KVLayout, num_slots: int, seed: int) -> list[list[torch.Tensor]]:
    """Random engine buffers of ``layout.name`` for one rank."""
    g = torch.Generator().manual_seed(seed)
    dt = layout.dtype.torch_dtype
    shape: tuple[int, ...]
    if layout.name is LayoutName.LAYER_SLOT_HEAD:
        shape = (num_slots, layout.heads_per_rank, layout.head_size)
        return [[torch.randn(shape, generator=g).to(dt) for _ in range(layout.num_layers)]
                for _ in range(layout.kv_dim)]
    shape = (layout.kv_dim, num_slots, layout.heads_per_rank, layout.head_size)
    return [[torch.randn(shape, generator=g).to(dt) for _ in range(layout.num_layers)]]


def zero_buffers(buffers: Sequence[Sequence[torch.Tensor]]) -> None:
    """Overwrite every tensor with zeros in place."""
    for group in buffers:
        for t in group:
            t.zero_()


def token_rows(layout: KVLayout, buffers: Sequence[Sequence[torch.Tensor]],
               slots: Sequence[int] | np.ndarray) -> list[torch.Tensor]:
    """The KV of ``slots`` in every plane (as raw bytes, to compare bit-exactly)."""
    idx = torch.as_tensor(np.asarray(slots), dtype=torch.int64)
    out = []
    for group in buffers:
        for t in group:
            sel = t.index_select(0, idx) if layout.name is LayoutName.LAYER_SLOT_HEAD \
                else t.index_select(1, idx)
            out.append(sel.contiguous().view(torch.uint8))
    return out


def same_rows(layout: KVLayout, buffers: Sequence[Sequence[torch.Tensor]],
              src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray) -> bool:
    """True when the slots ``dst`` hold, in every plane, the bytes of ``src``."""
    return all(x.equal(y) for x, y in zip(token_rows(layout, buffers, src),
                                          token_rows(layout, buffers, dst), strict=True))


def config(layout: KVLayout, cpu_blocks: int, ssd_blocks: int = 0, ssd_dir: Path | None = None,
           **kw: object) -> EmbeddedBackendConfig:
    """A config with tier sizes given in blocks."""
    bpb = layout.bytes_per_block
    return EmbeddedBackendConfig(
        layout=layout, cpu_bytes=cpu_blocks * bpb, ssd_bytes=ssd_blocks * bpb,
        ssd_paths=(str(ssd_dir),) if ssd_dir is not None else (), pinned=False, **kw,  # type: ignore[arg-type]
    )


def started(cfg: EmbeddedBackendConfig, num_slots: int = 256, seed: int = 1,
            ) -> tuple[EmbeddedBackend, list[list[list[torch.Tensor]]]]:
    """A started backend with every rank registered; returns it and each rank's buffers."""
    b = EmbeddedBackend(cfg)
    b.start()
    bufs = []
    for r in range(cfg.layout.tp_size):
        buf = make_buffers(cfg.layout, num_slots, seed + r)
        b.register_kv_buffers(r, buf)
        bufs.append(buf)
    return b, bufs


def tokens(n: int, seed: int = 0) -> np.ndarray:
    """Random int64 token ids."""
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64)


def _transfer(b: EmbeddedBackend, tid: int, mask: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Launch the matched task ``tid`` on the masked ``slots`` and wait for it
    (asserting SUCCESS); returns ``mask``. Nothing to do when nothing matched."""
    if tid < 0:
        return mask
    [wid] = b.launch([tid], [slots[: len(mask)][mask]])
    res = b.wait([wid], timeout=10)[wid]
    assert res.status.value == "success", res
    return mask


def store(b: EmbeddedBackend, toks: np.ndarray, slots: np.ndarray,
          namespace: str | None = None) -> np.ndarray:
    """put_match + launch + wait; returns the put mask (asserts SUCCESS when anything stored)."""
    return _transfer(b, *b.put_match(toks, namespace=namespace), slots)


def load(b: EmbeddedBackend, toks: np.ndarray, slots: np.ndarray,
         namespace: str | None = None) -> np.ndarray:
    """get_match + launch + wait; returns the get mask."""
    return _transfer(b, *b.get_match(toks, namespace=namespace), slots)


class PauseAt:
    """Checkpoint hook: at checkpoint ``n`` (1-based) signal ``entered`` and block
    until the copy is aborted; records every checkpoint reached afterwards."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0
        self.entered = threading.Event()
        self.after_abort = 0

    def __call__(self, abort: threading.Event | None) -> None:
        self.calls += 1
        if abort is not None and abort.is_set():
            self.after_abort += 1
        if self.calls == self.n:
            self.entered.set()
            assert abort is not None and abort.wait(5), "the copy was never aborted"


def planes(bufs: Sequence[Sequence[torch.Tensor]], slots: np.ndarray) -> list[torch.Tensor]:
    """Copies of the rows at ``slots`` of every plane (layer-slot-head layout)."""
    idx = torch.as_tensor(slots, dtype=torch.int64)
    return [t.index_select(0, idx).clone() for group in bufs for t in group]
