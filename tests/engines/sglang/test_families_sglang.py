"""kvcore's state-major Mamba layout against SGLang 0.5.23's own slot envelope.

SGLang 0.5.23 can keep every Mamba layer's conv and temporal (SSM) state of one slot in one
entry of a raw byte buffer (``mem_cache/layout/token_major.py``: ``mamba_entry_bytes``,
``build_mamba_entry_views``; ``[conv x layers][temporal x layers]`` per slot). A state-major
``mamba_group`` in a compound ``FamilyLayout`` is that entry: one slot is one kvcore block.
These tests build SGLang's own views over kvcore's virtual buffer and prove they alias
kvcore's (same addresses, same strides; written through one, read through the other),
whatever the engine mode of the session (they touch no patched code).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kvcore.memory.families import FamilyLayout, mamba_group
from tests.family_stack import HOST_GRANULARITY, open_stack, pattern

token_major = pytest.importorskip("sglang.srt.mem_cache.layout.token_major")
if "entry_bytes" not in inspect.signature(token_major.build_mamba_entry_views).parameters:
    # before 0.5.23 the envelope's row is exactly its states: no padded stride to view
    pytest.skip("this SGLang's Mamba envelope takes no entry_bytes", allow_module_level=True)

BF16, F32 = torch.bfloat16, torch.float32
SLOTS = 37  # SGLang's size + 1 (slot 0 is its dummy slot)


def envelope(layers: int, conv: tuple[int, ...], temporal: tuple[int, ...]) -> FamilyLayout:
    names = [f"model.layers.{i}.mixer" for i in range(layers)]
    group = mamba_group(
        names, states=[("conv", conv, BF16), ("ssm", temporal, F32)], state_major=True
    )
    return FamilyLayout([group], num_blocks=SLOTS, granularity=HOST_GRANULARITY)


def sglang_views(
    raw: torch.Tensor, layers: int, conv: tuple[int, ...], temporal: tuple[int, ...], entry: int
) -> tuple[torch.Tensor, torch.Tensor]:
    (conv_view,), ssm_view = token_major.build_mamba_entry_views(
        raw,
        layer_num=layers,
        conv_state_shapes=[conv],
        conv_dtype=BF16,
        temporal_state_shape=temporal,
        temporal_dtype=F32,
        max_slots=SLOTS,
        entry_bytes=entry,
    )
    return conv_view, ssm_view


def test_sglang_envelope_views_alias_kvcore_views() -> None:
    layers, conv, temporal = 4, (96, 3), (4, 16, 24)  # Mamba2-like shapes
    fam = envelope(layers, conv, temporal)
    entry = token_major.mamba_entry_bytes(
        layer_num=layers,
        conv_state_shapes=[conv],
        conv_dtype=BF16,
        temporal_state_shape=temporal,
        temporal_dtype=F32,
    )
    assert fam.plan.row_bytes == entry  # the same entry, byte for byte
    with open_stack("host", fam) as s:
        # the adapter hands SGLang kvcore's row stride (padded when no exact page fits)
        raw = s.cache.view(0, 0, torch.uint8, (fam.plan.row_stride,)).reshape(-1)
        conv_view, ssm_view = sglang_views(raw, layers, conv, temporal, fam.plan.row_stride)
        assert conv_view.shape == (layers, SLOTS, *conv)
        got = s.ledger.alloc(SLOTS)
        assert got is not None
        for i, name in enumerate(fam.groups[0].layers):
            for role, theirs in (("conv", conv_view[i]), ("ssm", ssm_view[i])):
                ours = fam.view(s.cache, name, role)
                assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
                assert ours.data_ptr() == theirs.data_ptr()
                for slot in (1, SLOTS // 2, SLOTS - 1):
                    ours[slot] = pattern(ours, slot, i)
                    assert torch.equal(theirs[slot], ours[slot])


def test_an_unaligned_envelope_sglang_refuses_is_aligned_by_kvcore() -> None:
    layers, conv, temporal = 3, (5, 3), (2, 8, 8)  # 90 conv bytes before an f32 region
    fam = envelope(layers, conv, temporal)
    assert fam.place("model.layers.0.mixer", "ssm").offset == 92
    raw = torch.zeros(SLOTS * fam.plan.row_stride, dtype=torch.uint8)
    with pytest.raises(AssertionError, match="misaligned"):
        sglang_views(raw, layers, conv, temporal, fam.plan.row_stride)
