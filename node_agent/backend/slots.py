"""Validation of engine slot mappings, before any byte moves."""

from __future__ import annotations

import numpy as np
import torch

_UNSIGNED_WIDE = tuple(getattr(torch, n) for n in ("uint32", "uint64") if hasattr(torch, n))


def validate_slot_mapping(
    value: object, expected_len: int, num_slots: int, what: str = "slot_mapping"
) -> torch.Tensor:
    """Return ``value`` as a CPU int64 tensor, or raise ``ValueError`` naming the bad value.

    Rules: a 1-D integer array (numpy or torch; bool and floating types are
    refused), ``expected_len`` entries, each in ``[0, num_slots)``, no duplicates.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{what} has dtype {value.dtype}; it must hold integer slot indices")
        if value.dtype in _UNSIGNED_WIDE:
            value = value.detach().cpu().numpy()  # checked below without wrapping
    if isinstance(value, torch.Tensor):
        arr = value.detach().to("cpu", torch.int64).numpy()
        ndim = value.dim()
    else:
        raw = np.asarray(value)
        if raw.dtype == np.bool_ or not np.issubdtype(raw.dtype, np.integer):
            raise ValueError(f"{what} has dtype {raw.dtype}; it must hold integer slot indices")
        if raw.dtype.kind == "u" and raw.size and raw.ndim == 1 and int(raw.max()) >= num_slots:
            # Checked before the int64 cast, which would wrap 2**63 + 5 to a negative slot.
            hi = int(raw.max())
            raise ValueError(
                f"{what} holds slot {hi} at index {int(raw.argmax())}, outside the registered "
                f"buffers' {num_slots} slots"
            )
        arr = raw.astype(np.int64, copy=False)
        ndim = raw.ndim
    if ndim != 1:
        raise ValueError(f"{what} has {ndim} dimensions (shape {tuple(arr.shape)}); it must be 1-D")
    if len(arr) != expected_len:
        raise ValueError(
            f"{what} has {len(arr)} entries but the task's mask selects {expected_len} tokens; "
            "pass one slot per masked token"
        )
    if expected_len:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0:
            raise ValueError(f"{what} holds negative slot {lo} at index {int(arr.argmin())}")
        if hi >= num_slots:
            raise ValueError(
                f"{what} holds slot {hi} at index {int(arr.argmax())}, outside the registered "
                f"buffers' {num_slots} slots"
            )
        if not _distinct(arr, lo, hi):
            uniq, counts = np.unique(arr, return_counts=True)
            dup = int(uniq[counts > 1][0])
            raise ValueError(
                f"{what} holds slot {dup} {int(counts[counts > 1][0])} times; each token "
                "needs its own slot"
            )
    return torch.from_numpy(np.ascontiguousarray(arr))


class CheckedSlots(np.ndarray):
    """A 1-D int64 slot mapping that :func:`validate_slot_mapping` accepted (non-negative,
    no slot twice) and that holds no slot above :attr:`hi`, so a later launch of it
    only checks its count and ``hi`` against the registered buffers
    (:func:`launch_slots`) instead of validating it again.

    Only :meth:`of` and :meth:`select` make a checked one: every other array numpy
    derives from it (a slice, fancy indexing that may repeat a slot, arithmetic)
    is an unchecked instance, validated in full like any array. A checked array
    owns its memory (:meth:`of` copies), so a caller that changes its own slot
    array after the check (say, while a retrieve waits for the followers) cannot
    change what is launched; nothing in the agent writes to a checked one."""

    checked: bool = False
    hi: int = -1

    def __array_finalize__(self, obj: object) -> None:
        self.checked = False
        self.hi = -1

    @classmethod
    def of(cls, validated: torch.Tensor) -> CheckedSlots:
        """A copy of the output of :func:`validate_slot_mapping` (which may share
        the caller's memory), checked."""
        out = validated.numpy().copy().view(cls)
        out.checked = True
        out.hi = int(out.max()) if len(out) else -1
        return out

    def select(self, mask: np.ndarray) -> CheckedSlots:
        """The slots where the bool ``mask`` (one flag per slot) is True, still
        checked: a subset of distinct, in-range slots is distinct and in range.
        Unchecked when this one is (or ``mask`` is not such a mask)."""
        mask = np.asarray(mask)
        out = np.ndarray.__getitem__(self, mask).view(CheckedSlots)
        if self.checked and mask.dtype == np.bool_ and mask.shape == self.shape:
            out.checked, out.hi = True, self.hi
        return out


def launch_slots(value: object, expected_len: int, num_slots: int,
                 what: str = "slot_mapping") -> torch.Tensor:
    """:func:`validate_slot_mapping`, but a :class:`CheckedSlots` (validated
    already) is only checked for its count and its largest slot."""
    if isinstance(value, CheckedSlots) and value.checked and len(value) == expected_len \
            and value.hi < num_slots and value.ndim == 1:
        return torch.from_numpy(np.ascontiguousarray(value, dtype=np.int64))
    return validate_slot_mapping(value, expected_len, num_slots, what)


_BITMAP_SPREAD = 64
"""Largest (max - min + 1) / entries for which :func:`_distinct` uses a bitmap."""


def _distinct(arr: np.ndarray, lo: int, hi: int) -> bool:
    """Whether the 1-D int64 ``arr`` (its minimum ``lo``, maximum ``hi``) holds no
    value twice. Slot mappings span a range not much wider than their length
    (pages of one engine buffer), so a bitmap of that range answers it in a
    fraction of a sort's time; a sparse one is sorted (``np.unique``)."""
    span = hi - lo + 1
    if span > _BITMAP_SPREAD * len(arr):
        return len(np.unique(arr)) == len(arr)
    seen = np.zeros(span, dtype=np.bool_)
    seen[arr - lo] = True
    return int(np.count_nonzero(seen)) == len(arr)


def check_whole_pages(slots: np.ndarray, page: int, what: str = "slot_mapping") -> None:
    """Raise ``ValueError`` unless ``slots`` are whole, aligned pages of ``page`` slots.

    A layout copied by whole pages only (``layer_block_head_token_kv``) needs
    every ``page`` consecutive entries to be one engine page in order: the
    first a multiple of ``page``, each next one the slot after it (slot =
    ``block * page + offset``). The message names the page size, the first
    offending position and its slot. ``slots`` is a validated 1-D int array.
    """
    n = len(slots)
    if n % page:
        raise ValueError(
            f"{what} has {n} slots, not a multiple of the page size {page}; the paged layout "
            f"is copied by whole pages: pass all {page} slots of each page"
        )
    if not n:
        return
    per_page = np.asarray(slots, dtype=np.int64).reshape(-1, page)
    starts = per_page[:, 0]
    off = per_page != starts[:, None] + np.arange(page, dtype=np.int64)
    bad_start = starts % page != 0
    bad = np.flatnonzero(bad_start | off.any(axis=1))
    if not len(bad):
        return
    b = int(bad[0])
    if bad_start[b]:
        pos, slot = b * page, int(starts[b])
        detail = (f"position {pos} starts a page with slot {slot}, not a multiple of the page "
                  f"size {page}")
    else:
        j = int(np.argmax(off[b]))
        pos, slot = b * page + j, int(per_page[b, j])
        detail = (f"position {pos} holds slot {slot} but page {int(starts[b]) // page} "
                  f"continues with slot {int(starts[b]) + j}")
    raise ValueError(
        f"{what} does not form whole, aligned pages of page size {page}: {detail}; the paged "
        f"layout is copied by whole pages: pass every slot of each page in order "
        f"(slot = block * {page} + offset)"
    )
