"""Validation of ``get_match`` / ``put_match`` inputs: token ids and the token mask."""

from __future__ import annotations

import numpy as np
import torch

from node_agent.backend.base import BoolMask


def mask_span(token_mask: object, num_tokens: int, tokens_per_block: int) -> tuple[int, int]:
    """The span ``[start, end)`` a token mask selects (all tokens when ``None``).

    The mask must be a bool array of ``num_tokens`` entries, True over one
    contiguous span starting at a block boundary; ``(0, 0)`` when all False.
    """
    if token_mask is None:
        return 0, num_tokens
    if isinstance(token_mask, torch.Tensor):
        token_mask = token_mask.cpu().numpy()
    m = np.asarray(token_mask)
    if m.dtype != np.bool_:
        raise ValueError(f"token_mask has dtype {m.dtype}; it must be bool")
    if m.shape != (num_tokens,):
        raise ValueError(
            f"token_mask has shape {m.shape} but token_ids has {num_tokens} entries; "
            "pass one bool per token"
        )
    idx = np.flatnonzero(m)
    if not len(idx):
        return 0, 0
    start, end = int(idx[0]), int(idx[-1]) + 1
    if end - start != len(idx):
        raise ValueError(
            f"token_mask is True at {len(idx)} tokens between {start} and {end}, not one "
            "contiguous span; mark one span"
        )
    if start % tokens_per_block:
        raise ValueError(
            f"token_mask starts at token {start}, not a multiple of tokens_per_block="
            f"{tokens_per_block}; start the span at a block boundary"
        )
    return start, end


def span_mask(num_tokens: int, start: int, end: int) -> BoolMask:
    """A bool mask of ``num_tokens`` True over ``[start, end)``."""
    mask = np.zeros(num_tokens, dtype=np.bool_)
    mask[start:end] = True
    return mask
