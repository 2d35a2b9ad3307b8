"""KV layout arithmetic and validation of registered engine buffers."""

from __future__ import annotations

import pytest
import torch

from node_agent.backend.planes import register_buffers
from node_agent.vocab.layout import KVDtype, KVLayout, LayoutName
from tests.backend.backend_helpers import make_buffers, small_layout


def test_llama3_8b_stage_bytes_per_block() -> None:
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_size=128, dtype=KVDtype.BFLOAT16)
    # 32 layers x K,V x 8 heads x 128 x 2 bytes x 16 tokens
    assert lay.bytes_per_block == 32 * 2 * 8 * 128 * 2 * 16 == 2 * 1024 * 1024
    assert lay.bytes_per_token == 128 * 1024


def test_tp_ranks_split_heads_and_mla_is_stored_once() -> None:
    mha = KVLayout(num_layers=2, num_kv_heads=8, head_size=64, tp_size=4)
    assert mha.heads_per_rank == 2 and mha.stored_ranks == 4
    assert mha.bytes_per_block == 4 * 2 * 2 * (2 * 64 * 2) * 16
    mla = KVLayout(num_layers=2, num_kv_heads=1, head_size=576, kv_dim=1, tp_size=4)
    assert mla.stored_ranks == 1 and mla.bytes_per_block == 2 * 576 * 2 * 16


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_layers": 0}, "num_layers=0"),
        ({"kv_dim": 3}, "kv_dim=3"),
        ({"dtype": "int8"}, "'int8'"),
        ({"num_kv_heads": 3, "tp_size": 2}, "num_kv_heads=3"),
        ({"tokens_per_block": -1}, "tokens_per_block=-1"),
        ({"name": "nope"}, "'nope'"),
    ],
)
def test_layout_errors_name_the_bad_value(kwargs: dict[str, object], needle: str) -> None:
    base: dict[str, object] = {"num_layers": 2, "num_kv_heads": 2, "head_size": 4}
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        KVLayout(**{**base, **kwargs})  # type: ignore[arg-type]


def test_dtype_aliases_parse() -> None:
    assert KVDtype.parse("bf16") is KVDtype.BFLOAT16
    assert KVDtype.parse(torch.float16) is KVDtype.FLOAT16
    assert KVLayout(1, 1, 1, dtype="fp32").dtype is KVDtype.FLOAT32  # type: ignore[arg-type]


def test_registration_keeps_views_of_engine_memory() -> None:
    lay = small_layout()
    bufs = make_buffers(lay, 10, 0)
    reg = register_buffers(lay, 0, bufs)
    assert reg.num_slots == 10 and len(reg.planes) == lay.num_planes
    reg.planes[1][3].fill_(7)  # plane 1 = layer 0, V
    assert bool((bufs[1][0][3] == 7).all())


def test_stacked_layout_registration_maps_planes() -> None:
    lay = small_layout(name=LayoutName.LAYER_KV_SLOT_HEAD)
    bufs = make_buffers(lay, 6, 0)
    reg = register_buffers(lay, 0, bufs)
    reg.planes[2 * 2 + 1][5].fill_(3)  # layer 2, V
    assert bool((bufs[0][2][1][5] == 3).all())


def _bad(lay: KVLayout, mutate: str) -> list[list[torch.Tensor]]:
    bufs = make_buffers(lay, 8, 0)
    if mutate == "dtype":
        bufs[0][1] = bufs[0][1].float()
    elif mutate == "shape":
        bufs[1][2] = torch.zeros(8, lay.heads_per_rank + 1, lay.head_size, dtype=torch.bfloat16)
    elif mutate == "slots":
        bufs[1][0] = torch.zeros(9, lay.heads_per_rank, lay.head_size, dtype=torch.bfloat16)
    elif mutate == "device":
        bufs[0][2] = torch.zeros(8, lay.heads_per_rank, lay.head_size, dtype=torch.bfloat16,
                                 device="meta")
    elif mutate == "strides":
        bufs[0][0] = torch.zeros(8, lay.head_size, lay.heads_per_rank,
                                 dtype=torch.bfloat16).transpose(1, 2)
    elif mutate == "layers":
        bufs[0] = bufs[0][:2]
    elif mutate == "lists":
        bufs = bufs[:1]
    elif mutate == "type":
        bufs[0][0] = [1, 2]  # type: ignore[call-overload]
    return bufs


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        ("dtype", r"buffers\[0\]\[1\] has dtype torch.float32, expected torch.bfloat16"),
        ("shape", r"buffers\[1\]\[2\] has shape \(8, 3, 8\), expected \(num_slots, 2, 8\)"),
        ("slots", r"buffers\[1\]\[0\] has 9 slots but earlier buffers have 8"),
        ("device", r"buffers\[0\]\[2\] is on meta but earlier buffers are on cpu"),
        ("strides", r"buffers\[0\]\[0\] has strides"),
        ("layers", r"buffer list 0 holds 2 tensors, expected num_layers=3"),
        ("lists", r"got 1 buffer lists, expected 2"),
        ("type", r"buffers\[0\]\[0\] is a list, expected a torch.Tensor"),
    ],
)
def test_registration_errors_name_the_bad_buffer(mutate: str, needle: str) -> None:
    lay = small_layout()
    with pytest.raises(ValueError, match=needle):
        register_buffers(lay, 0, _bad(lay, mutate))


def test_registration_rejects_rank_outside_tp() -> None:
    lay = small_layout(tp_size=2)
    with pytest.raises(ValueError, match=r"rank=2 is out of range.*\[0, 2\)"):
        register_buffers(lay, 2, make_buffers(lay, 4, 0))
