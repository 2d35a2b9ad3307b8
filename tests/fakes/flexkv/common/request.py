"""Fake of ``flexkv/common/request.py``: ``KVResponseStatus`` and ``KVResponse``.

Values are FlexKV's own (``NOTFOUND`` is ``"not_found"``), so an adapter that
maps statuses by value instead of by name breaks here as it would on FlexKV.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np


class KVResponseStatus(Enum):
    SUCCESS = "success"
    NOTFOUND = "not_found"
    UNREADY = "unready"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass
class KVResponse:
    """One task's answer; ``return_mask`` is a list of masks for a batch task."""

    status: KVResponseStatus
    task_id: int
    return_mask: np.ndarray | list[np.ndarray] | None
