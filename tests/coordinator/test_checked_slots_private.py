"""What a retrieve or store validates is what it marks checked: a caller thread that
changes its own slot array right after the validation cannot put an unchecked (here
a repeated) slot into the array a launch trusts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from node_agent.backend import slots as slots_module
from node_agent.coordinator import inputs


def _mutating(target: list[Any]) -> Callable[..., torch.Tensor]:
    """validate_slot_mapping, after which the caller's array gets a repeated slot."""
    real = slots_module.validate_slot_mapping

    def validate(value: object, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(value, *args, **kwargs)
        arr = target[0]
        arr[1] = arr[0]  # the caller's thread writes its own array now
        return out

    return validate


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_retrieve_marks_checked_only_what_it_validated(
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    mine = np.arange(100, 108, dtype=np.int64)
    caller: Any = mine if kind == "numpy" else torch.from_numpy(mine)
    monkeypatch.setattr(inputs, "validate_slot_mapping", _mutating([caller]))
    got = inputs.prepare_slots(caller, 8, 1024)
    assert got.checked
    assert list(got) == list(range(100, 108))
    assert len(set(got.tolist())) == 8


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_store_marks_checked_only_what_it_validated(
        monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    mine = np.arange(100, 116, dtype=np.int64)
    caller: Any = mine if kind == "numpy" else torch.from_numpy(mine)
    monkeypatch.setattr(inputs, "validate_slot_mapping", _mutating([caller]))
    got = inputs.prepare_store(np.arange(16, dtype=np.int64), caller, 16, num_slots=1024)
    assert got.slots.checked
    assert list(got.slots) == list(range(100, 116))
