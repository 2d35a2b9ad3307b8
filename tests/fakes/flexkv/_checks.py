"""Argument checks shared by the fake's modules; each failure names the value and the rule."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def check_int(name: str, value: Any, minimum: int | None = None) -> None:
    """``value`` must be a plain int (bool and numpy ints rejected) >= ``minimum``."""
    if type(value) is not int:
        raise TypeError(f"fake flexkv: {name} must be int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise AssertionError(f"fake flexkv: {name} must be >= {minimum}, got {value}")


def check_bool(name: str, value: Any) -> None:
    if type(value) is not bool:
        raise TypeError(f"fake flexkv: {name} must be bool, got {type(value).__name__} {value!r}")


def check_str(name: str, value: Any) -> None:
    if type(value) is not str:
        raise TypeError(f"fake flexkv: {name} must be str, got {type(value).__name__} {value!r}")


def as_cpu_numpy(name: str, value: Any) -> np.ndarray:
    """FlexKV accepts numpy arrays or CPU torch tensors (it calls ``.numpy()``)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise AssertionError(
                f"fake flexkv: {name} must be on the CPU (FlexKV calls .numpy()), "
                f"got a tensor on {value.device}"
            )
        return value.numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"fake flexkv: {name} must be a numpy array or CPU torch tensor, "
            f"got {type(value).__name__}"
        )
    return value


def check_token_ids(value: Any) -> np.ndarray:
    """Token ids: int64, 1-D, on the CPU (cache_engine._check_input asserts dtype and ndim)."""
    arr = as_cpu_numpy("token_ids", value)
    if arr.dtype != np.int64:
        raise AssertionError(f"fake flexkv: token_ids must be int64, got {arr.dtype}")
    if arr.ndim != 1:
        raise AssertionError(f"fake flexkv: token_ids must be 1-D, got shape {arr.shape}")
    return arr


def check_token_mask(value: Any, n: int) -> np.ndarray | None:
    """A bool 1-D mask of ``n`` entries. FlexKV's get_match indexes ``token_ids[token_mask]``,
    so an integer mask would silently gather tokens instead of masking them."""
    if value is None:
        return None
    arr = as_cpu_numpy("token_mask", value)
    if arr.dtype != np.bool_:
        raise AssertionError(
            f"fake flexkv: token_mask must be a bool array (an integer mask is used as "
            f"indices by get_match), got {arr.dtype}"
        )
    if arr.shape != (n,):
        raise AssertionError(
            f"fake flexkv: token_mask must have shape ({n},) like token_ids, got {arr.shape}"
        )
    idx = np.flatnonzero(arr)
    if len(idx) and idx[-1] - idx[0] + 1 != len(idx):
        raise AssertionError(
            "fake flexkv: token_mask must be True over one contiguous span; FlexKV uses only "
            f"its first and last True and would move the {idx[-1] - idx[0] + 1 - len(idx)} "
            "tokens in the holes too"
        )
    return arr


def check_namespace(value: Any) -> None:
    """FlexKV's namespace is ``Optional[List[str]]``; a bare str would be hashed char by char."""
    if value is None:
        return
    if not isinstance(value, list) or not all(type(v) is str for v in value):
        raise TypeError(
            f"fake flexkv: namespace must be None or a list of str, got {value!r}"
        )


def check_task_ids(value: Any) -> list[int]:
    """``task_ids``: an int or a list of ints (KVManager wraps a bare int)."""
    if type(value) is int:
        return [value]
    if not isinstance(value, list):
        raise TypeError(
            "fake flexkv: task_ids must be int or "
            f"list[int], got {type(value).__name__}"
        )
    for tid in value:
        check_int("task id", tid)
    return list(value)


def check_timeout(value: Any) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"fake flexkv: timeout must be a number, got {type(value).__name__}")
    if not value >= 0 or value == float("inf"):
        raise AssertionError(f"fake flexkv: timeout must be finite and >= 0, got {value}")
    return float(value)
