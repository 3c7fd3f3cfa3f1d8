"""Elastic KV resolves a block-outermost KV cache layout without ``VLLM_KV_CACHE_LAYOUT``.

Runs in the ``test-vllm-*`` nox sessions (the forked wheel, no GPU). The layouts come from the
real attention backends through vLLM's own ``get_supported_kv_cache_layouts`` and are resolved
by vLLM's own ``resolve_kv_cache_layout``, as the engine core does (``core.py`` passes them
through ``elastic_kv_cache_layouts`` first when elastic KV is on). A dense model planned on the
resolved layout then serves under the real scheduler with vLLM's views over kvcore's rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_layout", reason="the test-vllm-* nox sessions run these")
from test_elastic_families import BF16, Engine, MiB, _close_engines, _prompt
from vllm.config import DeviceConfig, VllmConfig
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import RequestStatus

from kvcore.adapters.vllm import elastic_kv_cache_layouts
from kvcore.adapters.vllm.layouts import block_outermost_form
from kvcore.errors import UnsupportedConfiguration

__all__ = ["_close_engines"]  # the autouse fixture that closes the engines built here


@pytest.fixture(autouse=True)
def _no_layout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


def _config() -> Any:
    return VllmConfig(device_config=DeviceConfig(device="cpu"))


def _worker_layouts(*backends: type) -> list[list[str]]:
    """What ``Executor.get_supported_kv_cache_layouts`` returns for one worker."""
    return [[layout.name for layout in get_supported_kv_cache_layouts(backends)]]


@pytest.mark.parametrize("backend", [FlashAttentionBackend, TritonAttentionBackend])
def test_elastic_resolves_the_block_outermost_form_of_vllms_choice(backend: type) -> None:
    supported = _worker_layouts(backend)
    upstream = resolve_kv_cache_layout(_config(), supported, [])
    assert upstream.name == "LBNHC" and not upstream.is_block_outermost
    elastic = resolve_kv_cache_layout(_config(), elastic_kv_cache_layouts(_config(), supported), [])
    assert elastic.name == "BLNHC" == block_outermost_form(upstream.name)
    # the per-layer block keeps the kernels' [N, H, C] order; only blocks move outermost
    assert elastic.layer_view_order == upstream.layer_view_order
    assert elastic.is_block_outermost and elastic.is_block_compact


def test_each_backend_order_is_kept_among_block_outermost_layouts() -> None:
    # FlashInfer's declaration (HND first), as its worker reports it
    assert elastic_kv_cache_layouts(_config(), [["LBHNC", "BLHNC"]]) == [["BLHNC"]]
    ranks = [["LBHNC", "LBNHC", "BLNHC", "BLHNC"]] * 2  # every rank reports its list
    assert elastic_kv_cache_layouts(_config(), ranks) == [["BLHNC", "BLNHC"]] * 2


def test_backends_without_a_block_outermost_layout_fail_at_start_up() -> None:
    with pytest.raises(UnsupportedConfiguration) as err:
        elastic_kv_cache_layouts(_config(), [["LBNHC", "LBHNC"]])
    assert "LBNHC, LBHNC" in str(err.value) and "--attention-backend" in err.value.hint


@pytest.mark.parametrize(("requested", "form"), [("NHD", "BLNHC"), ("LBHNC", "BLHNC")])
def test_a_layer_outermost_env_layout_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, requested: str, form: str
) -> None:
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", requested)
    with pytest.raises(UnsupportedConfiguration) as err:
        elastic_kv_cache_layouts(_config(), _worker_layouts(FlashAttentionBackend))
    assert f"VLLM_KV_CACHE_LAYOUT={requested}" in str(err.value)
    assert f"VLLM_KV_CACHE_LAYOUT={form}" in err.value.hint


def test_a_block_outermost_env_layout_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "BLHNC")
    narrowed = elastic_kv_cache_layouts(_config(), _worker_layouts(FlashAttentionBackend))
    assert resolve_kv_cache_layout(_config(), narrowed, []).name == "BLHNC"


def test_a_recorded_layer_outermost_layout_is_refused() -> None:
    config = _config()
    config.cache_config.kv_cache_layout = "LBNHC"
    with pytest.raises(UnsupportedConfiguration, match=r"cache_config\.kv_cache_layout=LBNHC"):
        elastic_kv_cache_layouts(config, _worker_layouts(FlashAttentionBackend))


def test_dense_model_serves_on_blnhc_rows() -> None:
    """Planned, validated, viewed and scheduled on the layout elastic KV resolves: vLLM's view
    of layer ``i`` in block ``b`` covers exactly the bytes kvcore places for it in row ``b``
    (written through vLLM's strided view, found whole in kvcore's region and nowhere else),
    and pages follow blocks until every request is done."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)
    eng = Engine({f"model.layers.{i}.attn": spec for i in range(4)}, 4 * MiB, layout="BLNHC")
    layout, cache = eng.memory.layout, eng.memory.cache
    assert cache is not None
    reqs = [eng.add(f"r{i}", _prompt(i, 100), max_tokens=30) for i in range(3)]
    eng.step()
    eng.assert_pages_follow_blocks()
    (group,) = layout.groups
    for block in eng.block_ids("r1")[0]:
        regions = [
            layout.view(cache, layer, group.cell[0].role)[block].view(torch.uint8)
            for layer in group.layers
        ]
        for region in regions:
            region.zero_()
        for i, layer in enumerate(group.layers):
            theirs = eng.views[layer][block]  # [H, N, C], physically [N, H, C]
            assert theirs.data_ptr() == regions[i].data_ptr()
            theirs.fill_(1.0)  # bf16 1.0: both bytes non-zero
            assert theirs.numel() * theirs.element_size() == regions[i].numel()
            assert bool((regions[i] != 0).all()), f"{layer}: vLLM's view left kvcore bytes"
            assert not any(bool(r.any()) for r in regions[i + 1 :]), f"{layer} spilled over"
    eng.run(each=eng.assert_pages_follow_blocks)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert eng.memory.stats().in_use == 1  # the null block's page
