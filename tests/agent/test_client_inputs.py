"""Token ids and KV slot indices must be integers by type: the client and the wire
encoder refuse floats, bools and values outside int64 instead of truncating or
wrapping them into other slots (invariant 1). Nothing is sent for a refused call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.client import AgentUnavailableError, EngineClient, RankInfo
from node_agent.engine_api import protocol
from node_agent.vocab.tokens import int64_array

BAD: list[tuple[Any, str]] = [
    ([0.5, 1.7, 2.2], "float64"),
    (torch.tensor([0.0, 1.0, 2.0]), "float32"),
    (np.array([0.0, 1.0, 2.0], dtype=np.float16), "float16"),
    ([True, False, True], "bool"),
    (torch.tensor([True, False, True]), "bool"),
    (np.array([0, 1, 2**63], dtype=np.uint64), "outside int64"),
    ([0, 1, 2**64], "outside int64"),
    (["0", "1", "2"], "<U1"),
]


def _client(tmp_path: Path) -> EngineClient:
    # No agent listens: a call that got past input checks would fail to connect.
    return EngineClient(tmp_path / "nobody.sock", RankInfo("r"), timeout=0.5)


@pytest.mark.parametrize(("bad", "fragment"), BAD)
def test_store_kv_refuses_non_integer_kv_indices(tmp_path: Path, bad: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=r"store_kv: kv_indices") as err:
        _client(tmp_path).store_kv("r1", [1, 2, 3], bad)
    assert fragment in str(err.value)


@pytest.mark.parametrize(("bad", "fragment"), BAD)
def test_store_kv_refuses_non_integer_token_ids(tmp_path: Path, bad: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=r"store_kv: token_ids") as err:
        _client(tmp_path).store_kv("r1", bad, [1, 2, 3])
    assert fragment in str(err.value)


@pytest.mark.parametrize(("bad", "fragment"), BAD)
def test_retrieve_refuses_non_integer_slot_mapping(tmp_path: Path, bad: Any,
                                                   fragment: str) -> None:
    with pytest.raises(ValueError, match=r"retrieve: slot_mapping") as err:
        _client(tmp_path).retrieve("r1", bad)
    assert fragment in str(err.value)


@pytest.mark.parametrize(("bad", "fragment"), BAD[:3])
def test_lookup_refuses_non_integer_token_ids(tmp_path: Path, bad: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=r"lookup: token_ids") as err:
        _client(tmp_path).lookup("r1", bad)
    assert fragment in str(err.value)


@pytest.mark.parametrize("good", [
    [0, 1, 2], np.array([0, 1, 2], dtype=np.int32), np.array([0, 1, 2], dtype=np.uint64),
    torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2], dtype=torch.int32), [np.int64(0), 1, 2],
])
def test_integer_inputs_pass_the_checks_unchanged(tmp_path: Path, good: Any) -> None:
    assert int64_array("x", good).tolist() == [0, 1, 2]
    # They get as far as the transport (no agent here).
    with pytest.raises(AgentUnavailableError):
        _client(tmp_path).store_kv("r1", [7, 8, 9], good)


def test_empty_arrays_are_int64() -> None:
    arr = int64_array("x", [])
    assert arr.dtype == np.int64 and arr.shape == (0,)


@pytest.mark.parametrize("bad", [[0.5, 1.7, 2.2], [True, False], np.array([1.0])])
def test_encoder_never_casts_unsafely(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"store_kv: kv_indices has dtype"):
        protocol.encode_request(1, "store_kv", {"rid": "r", "rank": {}},
                                {"token_ids": np.arange(len(bad)), "kv_indices": bad})
    with pytest.raises(ValueError, match=r"lookup: token_mask has dtype float64"):
        protocol.encode_request(1, "lookup", {"rid": "r", "rank": {}},
                                {"token_ids": [1, 2], "token_mask": [0.5, 1.0]})


def test_a_commit_not_waited_for_says_when_it_could_not_be_sent(tmp_path: Path) -> None:
    """``end_claim_nowait`` never raises for a load the fence already showed held:
    with no agent listening it answers False (the claim then ends with its lease)."""
    client = _client(tmp_path)
    assert client.end_claim_nowait("r1", 7) is False
    with pytest.raises(AgentUnavailableError):  # an answered call still says why
        client.commit_load("r1", 7)
