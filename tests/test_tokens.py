"""The one rule set for token ids and KV slot indices (node_agent/vocab/tokens.py),
and that every layer taking them from an engine applies it: the client, the wire
encoder, SGLang's connector, the coordinator's input checks and both backends
accept and refuse the same inputs."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.coordinator.inputs import prepare_lookup, prepare_store
from node_agent.engine_api import protocol
from node_agent.vocab.tokens import holds_bool, int64_array

REPO = Path(__file__).resolve().parents[1]
INT64_MAX = int(np.iinfo(np.int64).max)

INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
TORCH_INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_numpy_arrays_of_every_integer_dtype_become_int64(dtype: Any) -> None:
    out = int64_array("token_ids", np.array([0, 5, 127], dtype=dtype))
    assert out.dtype == np.int64 and out.tolist() == [0, 5, 127]
    assert out.flags.c_contiguous


@pytest.mark.parametrize("dtype", TORCH_INT_DTYPES)
def test_torch_tensors_of_integer_dtypes_become_int64(dtype: torch.dtype) -> None:
    out = int64_array("token_ids", torch.tensor([0, 5, 127], dtype=dtype))
    assert isinstance(out, np.ndarray) and out.dtype == np.int64
    assert out.tolist() == [0, 5, 127]


@pytest.mark.parametrize("values", [[0, 5, 127], (0, 5, 127), [np.int32(0), 5, np.uint64(127)],
                                    np.array([0, 5, 127], dtype=object)])
def test_python_sequences_of_ints_become_int64(values: Any) -> None:
    assert int64_array("token_ids", values).tolist() == [0, 5, 127]


def test_an_int64_array_is_taken_as_it_is() -> None:
    arr = np.arange(16, dtype=np.int64)
    assert int64_array("token_ids", arr) is arr


def test_a_strided_view_is_made_contiguous() -> None:
    out = int64_array("token_ids", np.arange(16, dtype=np.int64)[::2])
    assert out.flags.c_contiguous and out.tolist() == list(range(0, 16, 2))


def test_int64_extremes_are_kept_exactly() -> None:
    lo, hi = int(np.iinfo(np.int64).min), INT64_MAX
    assert int64_array("x", [lo, 0, hi]).tolist() == [lo, 0, hi]
    assert int64_array("x", np.array([hi], dtype=np.uint64)).tolist() == [hi]


@pytest.mark.parametrize("empty", [[], (), np.zeros(0), np.zeros(0, dtype=bool),
                                   torch.zeros(0, dtype=torch.int64),
                                   torch.zeros(0, dtype=torch.int32)])
def test_empty_input_of_any_dtype_is_an_empty_int64_array(empty: Any) -> None:
    out = int64_array("token_ids", empty)
    assert out.dtype == np.int64 and out.shape == (0,)


@pytest.mark.parametrize(("bad", "fragment"), [
    ([True, False, True], "has dtype bool (a bool among the values)"),
    ([0, True, 2], "has dtype bool (a bool among the values)"),
    ([0, np.bool_(False), 2], "has dtype bool (a bool among the values)"),
    (np.array([True, False]), "has dtype bool"),
    (torch.tensor([True, False]), "has dtype torch.bool"),
])
def test_bools_are_refused_wherever_they_are(bad: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=r"^store_kv: token_ids ") as err:
        int64_array("store_kv: token_ids", bad)
    assert fragment in str(err.value)


@pytest.mark.parametrize(("bad", "fragment"), [
    ([0.5, 1.7, 2.2], "has dtype float64"),
    ([0, 1.0, 2], "has dtype float64"),
    (np.array([0.0, 1.0], dtype=np.float16), "has dtype float16"),
    (np.array([1 + 2j]), "has dtype complex128"),
    (torch.tensor([0.0, 1.0]), "has dtype torch.float32"),
    (torch.arange(4, dtype=torch.bfloat16), "has dtype torch.bfloat16"),
    (["0", "1"], "has dtype <U1"),
    (np.array([1, "a"], dtype=object), "holds values of type int, str"),
])
def test_non_integer_values_are_refused_never_rounded(bad: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=r"^retrieve: slot_mapping ") as err:
        int64_array("retrieve: slot_mapping", bad)
    assert fragment in str(err.value)
    assert "pass a 1-D sequence of integers" in str(err.value)


@pytest.mark.parametrize("bad", [np.arange(8).reshape(4, 2), torch.arange(8).reshape(4, 2),
                                 [[0, 1], [2, 3]], np.int64(3), 7])
def test_any_shape_but_1d_is_refused_never_flattened(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"^token_ids has shape .*; it must be 1-D"):
        int64_array("token_ids", bad)


@pytest.mark.parametrize(("bad", "value"), [
    (np.array([0, 2**63], dtype=np.uint64), 2**63),
    (np.array([0, 2**64 - 1], dtype=np.uint64), 2**64 - 1),
    ([0, 1, 2**63], 2**63),
    ([-1, 2**63], 2**63),
    ([0, 2**64], 2**64),
    ([0, -(2**63) - 1], -(2**63) - 1),
])
def test_values_outside_int64_are_refused_with_their_true_value(bad: Any, value: int) -> None:
    with pytest.raises(ValueError, match="outside int64") as err:
        int64_array("store_kv: kv_indices", bad)
    assert str(value) in str(err.value)


def test_none_and_unreadable_tensors_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"^token_ids is None; pass a 1-D sequence"):
        int64_array("token_ids", None)
    meta = torch.zeros(4, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"^token_ids has dtype torch.int64 \(.*\); pass"):
        int64_array("token_ids", meta)


def test_holds_bool_looks_into_nested_python_sequences_only() -> None:
    assert holds_bool([1, [2, True]]) and holds_bool((np.bool_(True),))
    assert not holds_bool([1, 2, 3]) and not holds_bool(np.array([True]))


# -- every layer applies the same rule set -------------------------------------------

SAME = [[0, 1, 2, 3], np.arange(4, dtype=np.uint32), torch.arange(4, dtype=torch.int16)]
REFUSED: list[tuple[Any, str]] = [
    ([0, True, 2, 3], "has dtype bool"),
    ([0.0, 1.0, 2.0, 3.0], "has dtype float64"),
    (np.array([0, 1, 2, 2**63], dtype=np.uint64), "outside int64"),
    (torch.arange(4, dtype=torch.bfloat16), "has dtype torch.bfloat16"),
]


@pytest.mark.parametrize("good", SAME)
def test_the_encoder_and_the_coordinator_accept_the_same_inputs(good: Any) -> None:
    frames = protocol.encode_request(1, "lookup", {"rid": "r", "rank": {}}, {"token_ids": good})
    assert protocol.decode_request([bytes(f) for f in frames]).arrays["token_ids"].tolist() \
        == [0, 1, 2, 3]
    assert prepare_lookup(good, None, 4).tokens.tolist() == [0, 1, 2, 3]
    assert prepare_store(good, np.arange(4), 4, 16).tokens.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(("bad", "fragment"), REFUSED)
def test_the_encoder_and_the_coordinator_refuse_the_same_inputs_alike(
        bad: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=r"lookup: token_ids") as err:
        protocol.encode_request(1, "lookup", {"rid": "r", "rank": {}}, {"token_ids": bad})
    assert fragment in str(err.value)
    with pytest.raises(ValueError, match=r"^lookup: token_ids") as err:
        prepare_lookup(bad, None, 4)
    assert fragment in str(err.value)
    with pytest.raises(ValueError, match=r"^store_kv: token_ids") as err:
        prepare_store(bad, np.arange(4), 4, 16)
    assert fragment in str(err.value)


def _defined_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def test_token_coercion_is_defined_once() -> None:
    """No module of the agent defines its own token coercion or bool-in-list check
    beside node_agent/vocab/tokens.py."""
    own = {"int64_array", "holds_bool", "_holds_bool", "as_token_ids", "token_array",
           "_token_array"}
    found = {f"{p.relative_to(REPO)}:{name}"
             for p in (REPO / "node_agent").rglob("*.py")
             for name in _defined_functions(p) & own}
    assert found == {"node_agent/vocab/tokens.py:int64_array",
                     "node_agent/vocab/tokens.py:holds_bool"}


def test_the_vocabulary_imports_no_other_agent_package() -> None:
    tree = ast.parse((REPO / "node_agent" / "vocab" / "tokens.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.startswith("node_agent") or m == "torch"}
