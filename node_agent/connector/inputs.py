"""Validation and page alignment of engine inputs, before any matching.

``store_kv``'s contract is the seed's: token ids and kv slot indices are
parallel arrays; lengths that differ raise ``ValueError`` naming both counts
and nothing is written. Slot indices must be 1-D integers, in range of the
registered buffers, non-negative and unique within one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from node_agent.backend.slots import validate_slot_mapping

IntArray = npt.NDArray[np.int64]


def token_array(token_ids: Sequence[int] | npt.NDArray[np.integer] | torch.Tensor) -> IntArray:
    """Token ids as a 1-D int64 CPU array (refuses floats, bools and 2-D input)."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"token_ids must be a 1-D sequence of integers, got shape {arr.shape} "
            f"dtype {arr.dtype}"
        )
    return arr.astype(np.int64, copy=False)


def _length(kv_indices: object) -> int:
    if isinstance(kv_indices, torch.Tensor):
        return int(kv_indices.shape[0]) if kv_indices.dim() else 1
    return len(np.asarray(kv_indices))


@dataclass(frozen=True)
class StoreInput:
    """A validated, page-aligned store request (``aligned`` tokens, maybe 0)."""

    tokens: IntArray
    slots: IntArray

    @property
    def aligned(self) -> int:
        """Tokens kept after alignment (a multiple of the page size)."""
        return len(self.tokens)


def prepare_store(
    token_ids: Sequence[int] | npt.NDArray[np.integer],
    kv_indices: torch.Tensor | npt.NDArray[np.integer],
    tokens_per_block: int,
    num_slots: int | None,
) -> StoreInput:
    """Validate a ``store_kv`` call and align it down to whole pages.

    Order matters: the length check comes first (seed contract), then slot
    validation of the aligned part (integer, 1-D, in ``[0, num_slots)`` when
    ``num_slots`` is known, unique), so a bad call raises before any decision.
    """
    tokens = token_array(token_ids)
    n, m = len(tokens), _length(kv_indices)
    if n != m:
        raise ValueError(f"store_kv: token_ids has {n} entries but kv_indices has {m} entries")
    aligned = (n // tokens_per_block) * tokens_per_block
    if aligned == 0:
        return StoreInput(tokens[:0], np.zeros(0, dtype=np.int64))
    slots = validate_slot_mapping(
        kv_indices[:aligned], aligned, num_slots if num_slots is not None else 1 << 62,
        what="store_kv: kv_indices",
    ).numpy()
    return StoreInput(tokens[:aligned], slots)


def prepare_slots(
    slot_mapping: torch.Tensor | npt.NDArray[np.integer] | Sequence[int],
    expected: int,
    num_slots: int | None,
) -> IntArray:
    """Validate a ``retrieve`` slot mapping: one slot per hit token."""
    return validate_slot_mapping(
        slot_mapping, expected, num_slots if num_slots is not None else 1 << 62,
        what="retrieve: slot_mapping",
    ).numpy()
