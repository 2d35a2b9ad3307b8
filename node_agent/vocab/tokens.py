"""Token ids and KV slot indices as int64 arrays: one coercion, one rule set.

Every layer that takes token ids or slot indices from an engine (the client
library, the wire encoder, SGLang's connector, the coordinator's input checks,
the backends) reads them with :func:`int64_array`, so an input is accepted or
refused the same way wherever it enters, with the same message.

The rule set (token ids and slot indices are parallel arrays: a value that is
truncated, rounded or wrapped would silently name another token or slot):

* accepted: a Python list or tuple of ints (numpy integer scalars among them),
  a numpy array of any signed or unsigned integer dtype, an object array of
  ints, and a torch tensor of an integer dtype on any device (it is copied to
  the CPU); an empty sequence of any dtype is an empty int64 array;
* refused with ``ValueError`` naming ``where``, the bad value or dtype and the
  fix: ``None``; a bool anywhere (a bool dtype, a bool tensor, ``True`` or
  ``False`` inside a list: numpy would read it as 1 or 0); a floating,
  complex, string or other non-integer dtype (never rounded); any shape but
  1-D (never flattened); a value outside int64 (a uint64 above 2**63 - 1, a
  Python int beyond 64 bits), named with its true value; anything numpy or
  torch cannot read.

The result is a C-contiguous int64 array, the input itself when it already is
one. This module imports neither torch nor any other ``node_agent`` package.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

Int64Array = npt.NDArray[np.int64]
"""A 1-D C-contiguous int64 array of token ids or slot indices."""

_INT64: Final = np.iinfo(np.int64)
_FIX: Final = ("pass a 1-D sequence of integers (an int64 numpy array or a torch.long tensor), "
               "not rounded values")


def holds_bool(values: object) -> bool:
    """True when a Python list or tuple holds a bool at any depth (numpy would
    read it as 1 or 0)."""
    if isinstance(values, list | tuple):
        return any(isinstance(v, bool | np.bool_) or holds_bool(v) for v in values)
    return False


def _tensor_to_numpy(where: str, values: object) -> object:
    """A torch tensor (recognised by duck typing, torch is not imported here) as a
    CPU numpy array; refuses non-integer tensor dtypes before converting (numpy
    has no bfloat16)."""
    dtype = getattr(values, "dtype", None)
    if (getattr(dtype, "is_floating_point", False) or getattr(dtype, "is_complex", False)
            or str(dtype) == "torch.bool"):
        raise ValueError(f"{where} has dtype {dtype} (not an integer type); {_FIX}")
    try:
        return values.detach().cpu().numpy()  # type: ignore[attr-defined]
    except (TypeError, RuntimeError) as exc:  # types numpy lacks, meta tensors
        raise ValueError(f"{where} has dtype {dtype} ({exc}); pass integers (an int64 "
                         "numpy array or a torch.long tensor)") from None


def int64_array(where: str, values: object) -> Int64Array:
    """``values`` as a 1-D C-contiguous int64 array under the module's rule set.

    ``where`` names the argument in every error (for example
    ``"store_kv: kv_indices"``). Raises ``ValueError`` naming ``where``, the bad
    dtype, shape or value, and the fix.
    """
    if values is None:
        raise ValueError(f"{where} is None; pass a 1-D sequence of integers")
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor
        values = _tensor_to_numpy(where, values)
    if holds_bool(values):
        raise ValueError(f"{where} has dtype bool (a bool among the values); pass integers, "
                         "not True/False")
    try:
        arr = np.asarray(values)
    except (OverflowError, ValueError, TypeError) as exc:
        raise ValueError(f"{where}: cannot be read as an integer array ({exc}); pass a flat "
                         "sequence of ints or an int64 array") from None
    if arr.ndim != 1:
        raise ValueError(f"{where} has shape {arr.shape}; it must be 1-D (one entry per "
                         "token), never flattened; pass a 1-D sequence of integers")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "O":
        return _object_int64(where, arr)
    if arr.dtype.kind == "f" and isinstance(values, list | tuple) and all(
            isinstance(v, int | np.integer) for v in values):
        # Python ints numpy typed as float64 (one beyond int64 among them): name it.
        return _object_int64(where, np.array(values, dtype=object))
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{where} has dtype {arr.dtype} (not an integer type); {_FIX}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8 and int(arr.max()) > _INT64.max:
        raise ValueError(f"{where} has dtype {arr.dtype} with value {int(arr.max())} outside "
                         "int64; token ids and slot indices must fit in int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _object_int64(where: str, arr: npt.NDArray[np.object_]) -> Int64Array:
    """An object array (Python ints numpy could not type, e.g. one beyond 64 bits)
    as int64, refusing any value that is not an int or does not fit."""
    if not all(isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)
               for v in arr):
        kinds = sorted({type(v).__name__ for v in arr})
        raise ValueError(f"{where} holds values of type {', '.join(kinds)}; {_FIX}")
    for v in arr:
        if int(v) < _INT64.min or int(v) > _INT64.max:
            raise ValueError(f"{where} holds {int(v)}, a value outside int64; token ids and "
                             "slot indices must fit in int64")
    return arr.astype(np.int64)
