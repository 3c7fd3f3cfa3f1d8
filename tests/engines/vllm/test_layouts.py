"""Elastic KV resolves a KV cache layout kvcore can back, and serves on each it can.

Runs in the ``test-vllm-*`` nox sessions (the forked wheel, no GPU). The layouts come from the
real attention backends through vLLM's own ``get_supported_kv_cache_layouts`` and are resolved
by vLLM's own ``resolve_kv_cache_layout``, as the engine core does (``core.py`` passes them
through ``elastic_kv_cache_layouts`` first when elastic KV is on). Models planned on the
layouts elastic KV runs (layer-outermost LBNHC, vLLM's own and elastic KV's on one GPU;
block-outermost BLNHC, its form under TP x PP or by ``VLLM_KV_CACHE_LAYOUT``) then serve
under the real scheduler with vLLM's views over kvcore's memory.
"""

from __future__ import annotations

import logging
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
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus

from kvcore.adapters.vllm import elastic_kv_cache_layouts
from kvcore.adapters.vllm.layouts import backable_layouts, block_outermost_form
from kvcore.errors import UnsupportedConfiguration

__all__ = ["_close_engines"]  # the autouse fixture that closes the engines built here


@pytest.fixture(autouse=True)
def _no_layout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


def _config(tp: int = 1) -> Any:
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    config.parallel_config.tensor_parallel_size = tp
    return config


def _worker_layouts(*backends: type) -> list[list[str]]:
    """What ``Executor.get_supported_kv_cache_layouts`` returns for one worker."""
    return [[layout.name for layout in get_supported_kv_cache_layouts(backends)]]


def _resolve(config: Any, supported: list[list[str]]) -> Any:
    return resolve_kv_cache_layout(config, elastic_kv_cache_layouts(config, supported), [])


@pytest.mark.parametrize("backend", [FlashAttentionBackend, TritonAttentionBackend])
def test_elastic_resolves_vllms_own_layout_on_one_gpu(backend: type) -> None:
    supported = _worker_layouts(backend)
    upstream = resolve_kv_cache_layout(_config(), supported, [])
    assert upstream.name == "LBNHC" and not upstream.is_block_outermost
    assert _resolve(_config(), supported).name == upstream.name  # kvcore's per-layer ranges


@pytest.mark.parametrize("backend", [FlashAttentionBackend, TritonAttentionBackend])
def test_elastic_resolves_the_block_outermost_form_under_tp(backend: type) -> None:
    supported = _worker_layouts(backend)
    upstream = resolve_kv_cache_layout(_config(2), supported, [])
    elastic = _resolve(_config(2), supported)
    assert elastic.name == "BLNHC" == block_outermost_form(upstream.name)
    # the per-layer block keeps the kernels' [N, H, C] order; only blocks move outermost
    assert elastic.layer_view_order == upstream.layer_view_order
    assert elastic.is_block_outermost and elastic.is_block_compact


def test_each_backend_order_is_kept_among_backable_layouts() -> None:
    # FlashInfer's declaration (HND first), as its worker reports it
    assert elastic_kv_cache_layouts(_config(), [["LBHNC", "BLHNC"]]) == [["LBHNC", "BLHNC"]]
    assert elastic_kv_cache_layouts(_config(2), [["LBHNC", "BLHNC"]]) == [["BLHNC"]]
    ranks = [["LHBNC", "LBHNC", "BHLNC", "LBNHC", "BLNHC"]] * 2  # every rank reports its list
    assert elastic_kv_cache_layouts(_config(), ranks) == [["LBHNC", "LBNHC", "BLNHC"]] * 2
    assert elastic_kv_cache_layouts(_config(2), ranks) == [["BLNHC"]] * 2
    assert backable_layouts(channel=False) == ("LBNHC", "LBHNC", "BLNHC", "BLHNC")


def test_backends_without_a_backable_layout_fail_at_start_up() -> None:
    with pytest.raises(UnsupportedConfiguration) as err:
        elastic_kv_cache_layouts(_config(), [["LHBNC", "BHLNC"]])
    assert "LHBNC, BHLNC" in str(err.value) and "--attention-backend" in err.value.hint
    with pytest.raises(UnsupportedConfiguration, match="TP x PP = 2"):
        elastic_kv_cache_layouts(_config(2), [["LBNHC", "LBHNC"]])  # no block-outermost form


@pytest.mark.parametrize(
    ("requested", "tp"), [("LHBNC", 1), ("BHLNC", 1), ("NHD", 2), ("LBHNC", 2)]
)
def test_an_env_layout_kvcore_cannot_back_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, requested: str, tp: int
) -> None:
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", requested)
    with pytest.raises(UnsupportedConfiguration) as err:
        elastic_kv_cache_layouts(_config(tp), _worker_layouts(FlashAttentionBackend))
    assert f"VLLM_KV_CACHE_LAYOUT={requested}" in str(err.value)
    assert "BLNHC" in err.value.hint


@pytest.mark.parametrize(
    ("requested", "tp"), [("NHD", 1), ("LBNHC", 1), ("BLHNC", 1), ("BLHNC", 2)]
)
def test_an_env_layout_kvcore_can_back_is_honoured(
    monkeypatch: pytest.MonkeyPatch, requested: str, tp: int
) -> None:
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", requested)
    resolved = _resolve(_config(tp), _worker_layouts(FlashAttentionBackend))
    assert resolved.name == {"NHD": "LBNHC"}.get(requested, requested)


def test_a_recorded_layout_kvcore_cannot_back_is_refused() -> None:
    config = _config()
    config.cache_config.kv_cache_layout = "LHBNC"
    with pytest.raises(UnsupportedConfiguration, match=r"cache_config\.kv_cache_layout=LHBNC"):
        elastic_kv_cache_layouts(config, _worker_layouts(FlashAttentionBackend))


def _assert_vllm_views_cover_kvcore_cells(eng: Engine, rid: str) -> None:
    """For each of ``rid``'s blocks and each layer: vLLM's view of the block (strided as the
    layout makes it) covers exactly the bytes kvcore places for it, written through vLLM's
    view and found whole in kvcore's cell and in no other layer's."""
    layout, cache = eng.memory.layout, eng.memory.cache
    assert cache is not None
    for gid, group in enumerate(layout.groups):
        for block in eng.block_ids(rid)[gid]:
            cells = [
                layout.view(cache, layer, group.cell[0].role)[block].view(torch.uint8)
                for layer in group.layers
            ]
            for cell in cells:
                cell.zero_()
            for i, layer in enumerate(group.layers):
                theirs = eng.views[layer][block]  # [H, N, C], physically as the layout says
                assert theirs.data_ptr() == cells[i].data_ptr()
                theirs.fill_(1.0)  # bf16 1.0: both bytes non-zero
                assert theirs.numel() * theirs.element_size() == cells[i].numel()
                assert bool((cells[i] != 0).all()), f"{layer}: vLLM's view left kvcore bytes"
                assert not any(bool(c.any()) for c in cells[i + 1 :]), f"{layer} spilled over"


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_dense_model_serves_on_the_resolved_layouts(
    layout: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Planned, validated, viewed and scheduled on each layout elastic KV runs: vLLM's
    view of each layer's block is kvcore's cell of it, and pages follow blocks until every
    request is done. LBNHC: one range per layer, vLLM's layer regions exactly (whole pages
    in each: the engine core trims ``num_blocks``)."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)
    layers = {f"model.layers.{i}.attn": spec for i in range(4)}
    eng = Engine(layers, 131 * 4 * spec.page_size_bytes, layout=layout)  # 131 blocks planned
    geometry = eng.memory.geometry
    assert geometry.layout == ("per-layer" if layout == "LBNHC" else "compound")
    if layout == "LBNHC":  # 8 blocks per 64 KiB page: the engine core trimmed to whole pages
        assert eng.kv.num_blocks == 128 == 16 * geometry.blocks_per_page
        (tensor,) = eng.kv.kv_cache_tensors
        assert tensor.layer_stride == geometry.range_bytes == eng.kv.num_blocks * 8192
    reqs = [eng.add(f"r{i}", _prompt(i, 100), max_tokens=30) for i in range(3)]
    eng.step()
    eng.assert_pages_follow_blocks()
    _assert_vllm_views_cover_kvcore_cells(eng, "r1")
    eng.run(each=eng.assert_pages_follow_blocks)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert eng.memory.stats().in_use == 1  # the null block's page
    with caplog.at_level(logging.INFO, logger="kvcore.adapters.vllm.memory"):
        eng.memory.close()  # the shutdown line says where the mapping work went
    (line,) = [r.getMessage() for r in caplog.records if "page allocator at shutdown" in r.msg]
    assert "mapper calls" in line and "0 misses" in line


def test_hybrid_model_serves_layer_outermost() -> None:
    """Full + sliding-window groups overlaid part by part on LBNHC: every group's layer ``i``
    is kvcore's range ``i``; the window frees blocks into the pool and pages follow."""
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=BF16, sliding_window=32
    )
    specs = {f"model.layers.{i}.attn": full if i % 3 == 2 else window for i in range(6)}
    eng = Engine(specs, 4 * MiB, layout="LBNHC")
    assert eng.memory.geometry.layout == "per-layer" and eng.memory.geometry.num_layers == 2
    reqs = [eng.add(f"h{i}", _prompt(i + 5, 160), max_tokens=40) for i in range(3)]
    eng.step()
    _assert_vllm_views_cover_kvcore_cells(eng, "h0")
    eng.run(each=eng.assert_pages_follow_blocks)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert eng.memory.stats().in_use == 1
