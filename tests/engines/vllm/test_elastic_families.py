"""Elastic KV for vLLM's model families under the real engine code (forked wheel, host backend).

Each test takes one model family through the path a patched engine takes:

1. vLLM's own planner builds the ``KVCacheConfig`` from real specs (``get_kv_cache_groups``,
   ``get_kv_cache_config_from_groups``, block-outermost ``BLHNC``);
2. the engine core's ``elastic_settings`` validates it (and pads the row where needed);
3. the worker's ``allocate_kv_cache`` (patched: its buffer is kvcore's virtual tensor) builds
   the per-layer views the model runner would use;
4. the real ``Scheduler`` / ``KVCacheManager`` (its coordinator builds the elastic pool through
   the patch seam, over the ledger of the same process's memory) serves requests.

Only the model runner is absent: each step's output is one sampled token per request, as in
vLLM's own scheduler tests. The tests prove that pages map as blocks fill and unmap when they
empty (a page is backed exactly while a block on it is allocated, whichever group holds it),
that every request finishes, that the views vLLM built alias kvcore's layout views of the same
bytes, and (hybrid) that vLLM's prefix cache keys entries by group with elastic on.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_families_vllm import mamba2_spec, planning
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from harness.vllm.scheduler import step
from kvcore.adapters.vllm import elastic_settings, memory_for
from kvcore.adapters.vllm.memory import ElasticKVMemory
from kvcore.adapters.vllm.pool import ElasticBlockPool
from kvcore.adapters.vllm.runtime import close_all

BF16 = torch.bfloat16
MiB = 1 << 20
GRAN = 64 << 10  # host backend granularity

init_none_hash(sha256)


_engines: list[Engine] = []


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    _engines.clear()
    close_all()  # the worker side's memory and the pools' own: every memory of the process


# -- the engine path -------------------------------------------------------------------------


class Engine:
    """One family's config, worker views, memory and scheduler, built as an engine would."""

    def __init__(
        self,
        specs: dict[str, Any],
        memory_bytes: int,
        *,
        caching: bool = False,
        granularity: int = GRAN,
        mamba_cache_mode: str = "none",
        elastic: bool = True,
        layout: str = "BLHNC",
        kvcore: dict[str, Any] | None = None,
    ) -> None:
        model = ModelConfig(model="facebook/opt-125m", dtype="float16", seed=42, max_model_len=2048)
        sched = SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=2048,
            max_model_len=2048,
            enable_chunked_prefill=True,
            async_scheduling=False,
            is_encoder_decoder=False,
            watermark=0.0,
        )
        sched.disable_hybrid_kv_cache_manager = False  # the hybrid allocator
        cache = CacheConfig(block_size=16, cache_dtype="auto", enable_prefix_caching=caching)
        cache.mamba_cache_mode = mamba_cache_mode  # type: ignore[assignment]
        cache.kv_cache_layout = layout
        backend = {"granularity": granularity, "device_bytes": 1 << 30}
        cache.kvcore_elastic = elastic
        cache.kvcore_config = {"backend": "host", "backend_options": backend, **(kvcore or {})}
        self.vllm_config = VllmConfig(
            scheduler_config=sched, model_config=model, cache_config=cache
        )
        register_all_kvcache_specs(self.vllm_config)  # as at engine start: before planning
        groups = planning.get_kv_cache_groups(self.vllm_config, specs)
        self.kv = planning.get_kv_cache_config_from_groups(self.vllm_config, groups, memory_bytes)
        self.planned_stride = self.kv.kv_cache_tensors[0].block_stride
        self.kv.kv_cache_layout = layout
        if elastic:  # the engine core: validation (and padding) before any worker allocates
            self.kv.kvcore = elastic_settings(self.vllm_config, self.kv)
        # the worker: vLLM's views over kvcore's buffer
        self.views = allocate_kv_cache(self.kv, torch.device("cpu"), KVCacheLayout[layout])
        if elastic:
            self.memory: ElasticKVMemory = memory_for(self.kv)
            _engines.append(self)  # closed after the test even if the scheduler fails to build
        cache.num_gpu_blocks = self.kv.num_blocks
        block, hash_block = resolve_kv_cache_block_sizes(self.kv, self.vllm_config)
        self.hasher = get_request_block_hasher(hash_block, sha256)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv,
            block_size=block,
            hash_block_size=hash_block,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
        )
        pool = self.scheduler.kv_cache_manager.block_pool
        assert isinstance(pool, ElasticBlockPool) == elastic
        if elastic:
            assert pool.ledger is self.memory.ledger  # the pool took the worker's memory
        self.pool = pool

    # -- requests

    def add(self, rid: str, tokens: list[int], max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(
            request_id=rid,
            prompt_token_ids=tokens,
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(req)
        return req

    def step(self) -> Any:
        return step(self.scheduler)  # one sampled token per scheduled request

    def run(self, *, limit: int = 2000, each: Any = None) -> int:
        steps = 0
        while self.scheduler.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps < limit
            if each is not None:
                each()
        return steps

    # -- what kvcore holds

    def block_ids(self, rid: str) -> tuple[list[int], ...]:
        """The request's block table, group by group (null blocks left out)."""
        tables = self.scheduler.kv_cache_manager.get_block_ids(rid)
        return tuple([b for b in table if b != 0] for table in tables)

    def assert_pages_follow_blocks(self) -> None:
        """A page is in use exactly while a block on it is allocated (invariant 1)."""
        ledger = self.memory.ledger
        geometry = self.memory.geometry
        live = {geometry.page_of(b) for b in range(geometry.num_blocks) if ledger.is_allocated(b)}
        assert self.memory.stats().in_use == len(live)

    def assert_views_alias(self, rid: str, salt: int) -> None:
        """Write each layer's block through vLLM's view, read it through kvcore's layout
        view: the same bytes at the same address (only blocks of that layer's group)."""
        layout = self.memory.layout
        cache = self.memory.cache
        assert cache is not None
        tables = self.block_ids(rid)
        for gid, group in enumerate(layout.groups):
            for i, layer in enumerate(group.layers):
                theirs = self.views[layer]
                for block in tables[gid][:3] + tables[gid][-1:]:
                    raw = theirs[block].view(torch.uint8).reshape(-1)
                    fill = torch.arange(raw.numel(), dtype=torch.int64)
                    raw.copy_(((fill * 7 + block * 13 + i + salt) % 251).to(torch.uint8))
                    base = raw.data_ptr()
                    for state in group.cell:
                        ours = layout.view(cache, layer, state.role)[block]
                        start = ours.data_ptr() - base
                        nbytes = ours.numel() * ours.element_size()
                        assert start >= 0 and start + nbytes <= raw.numel()
                        got = ours.contiguous().view(torch.uint8).reshape(-1)
                        assert torch.equal(got, raw[start : start + nbytes])


def _mamba2(block_size: int, mode: str = "none", padded: int | None = None) -> MambaSpec:
    spec = mamba2_spec(block_size)  # vLLM's own Mamba2 state shapes
    return dataclasses.replace(spec, mamba_cache_mode=mode, page_size_padded=padded)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 1009 + i * 31) % 30000 + 1 for i in range(n)]


# -- hybrid: full attention + sliding window (Gemma-style) ------------------------------------


def gemma_specs(window: int) -> dict[str, Any]:
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=BF16)
    swa = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=BF16, sliding_window=window
    )
    return {f"model.layers.{i}.attn": full if i % 3 == 2 else swa for i in range(6)}


def test_hybrid_full_and_sliding_window_pages_follow_blocks() -> None:
    eng = Engine(gemma_specs(window=32), 4 * MiB)
    kinds = [g.kind for g in eng.memory.layout.groups]
    assert sorted(kinds) == ["attention", "sliding_window", "sliding_window"]
    assert eng.memory.stats().in_use == 1  # the null block's page
    reqs = [eng.add(f"r{i}", _prompt(i, 160), max_tokens=40) for i in range(4)]
    eng.step()
    eng.assert_pages_follow_blocks()
    peak = eng.memory.stats().in_use
    assert peak > 1
    for r in reqs:
        eng.assert_views_alias(r.request_id, salt=1)
    full_gid = kinds.index("attention")
    swa_gid = kinds.index("sliding_window")

    def check() -> None:
        eng.assert_pages_follow_blocks()
        for r in eng.scheduler.running:
            tables = eng.block_ids(r.request_id)
            if r.num_computed_tokens > 3 * 32:  # the window dropped the early blocks
                assert len(tables[swa_gid]) < len(tables[full_gid])

    eng.run(each=check)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert eng.pool.ledger.used() == 1
    assert eng.memory.stats().in_use == 1  # every page that emptied went back


@pytest.mark.parametrize(("option", "interval"), [({}, 50e-6), ({"background_switch_us": 0}, None)])
def test_the_page_thread_takes_the_configured_switch_interval(
    option: dict[str, Any], interval: float | None
) -> None:
    eng = Engine(gemma_specs(window=32), 4 * MiB, kvcore=option)
    assert eng.memory.pages is not None
    assert eng.memory.pages.switch_interval == (
        pytest.approx(interval) if interval is not None else None
    )


def _prefix_hit(elastic: bool) -> tuple[Engine, list[int]]:
    """Two requests sharing an 8-block prompt; the tokens the second found cached."""
    eng = Engine(gemma_specs(window=512), 4 * MiB, caching=True, elastic=elastic)
    prompt = _prompt(3, 8 * 16)
    eng.add("a", prompt, max_tokens=1)
    eng.run()
    eng.add("b", [*prompt, 5], max_tokens=1)
    out = eng.step()
    return eng, [r.num_computed_tokens for r in out.scheduled_new_reqs]


def test_hybrid_prefix_cache_hits_as_upstream_with_elastic_on() -> None:
    _, hits_upstream = _prefix_hit(elastic=False)
    eng, hits = _prefix_hit(elastic=True)
    assert hits == hits_upstream and hits[0] >= 7 * 16  # vLLM's own hybrid hit, unchanged
    eng.run(each=eng.assert_pages_follow_blocks)
    cached = eng.pool.num_cached_free_blocks()
    assert cached == eng.pool.ledger.used() - 1 > 0  # what stays cached stays backed
    assert eng.pool.trim(10**6) == cached
    assert eng.memory.stats().in_use == 1


def test_hybrid_prefix_cache_is_keyed_by_group_with_elastic_on() -> None:
    eng = Engine(gemma_specs(window=512), 4 * MiB, caching=True)
    groups = len(eng.kv.kv_cache_groups)
    prompt = _prompt(3, 8 * 16)
    eng.add("a", prompt, max_tokens=1)
    eng.run()
    cached = eng.pool.num_cached_free_blocks()
    assert eng.pool.ledger.used() == 1 + cached  # cached blocks stay allocated and backed
    eng.assert_pages_follow_blocks()
    hashed = [b for b in eng.pool.blocks if b.block_hash is not None]
    assert len(hashed) == cached
    keys = [b.block_hash for b in hashed]
    per_group = Counter(get_group_id(k) for k in keys)
    full_gid = [g.kind for g in eng.memory.layout.groups].index("attention")
    assert per_group[full_gid] == 8  # every full block of the prompt, under the group's key
    assert sorted(per_group) == list(range(groups))  # the window groups keep what they retain
    table = eng.pool.cached_block_hash_to_block
    assert all(table.get_one_block(b.block_hash) is b for b in hashed)
    digests = Counter(get_block_hash(k) for k in keys)
    # the prompt's first block: one digest, one entry and one block id in every group
    assert max(digests.values()) == groups
    assert eng.pool.trim(10**6) == cached
    assert eng.pool.ledger.used() == 1
    assert eng.memory.stats().in_use == 1


# -- Mamba hybrid: attention + Mamba2 state cells ---------------------------------------------


def mamba_hybrid_specs(mode: str) -> dict[str, Any]:
    """Attention + Mamba2 layers as vLLM's hybrid model config sizes them: the attention block
    size grows until its page holds a Mamba state cell, and the cell is padded to that page
    (``page_size_padded``), so every layer has one page size."""
    cell = _mamba2(16).page_size_bytes
    per_token = 2 * 2 * 64 * 2  # K and V, 2 heads of 64, bf16
    block = 16 * -(-cell // (16 * per_token))
    full = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64, dtype=BF16)
    mamba = _mamba2(block, mode, padded=block * per_token)
    return {"l0.attn": full, "l1.mixer": mamba, "l2.mixer": mamba, "l3.attn": full}


def test_mamba_hybrid_state_slots_map_and_unmap() -> None:
    eng = Engine(mamba_hybrid_specs("none"), 8 * MiB)
    layout = eng.memory.layout
    mamba = [g for g in layout.groups if g.kind == "mamba"]
    attention = [g for g in layout.groups if g.kind == "attention"]
    # the padded page: each Mamba cell is padded to the attention page (page_size_padded)
    assert mamba and all(g.stride == attention[0].stride > g.cell_bytes for g in mamba)
    assert layout.plan.row_bytes == eng.kv.kv_cache_tensors[0].block_stride
    reqs = [eng.add(f"m{i}", _prompt(i + 10, 100), max_tokens=20) for i in range(3)]
    eng.step()
    eng.assert_pages_follow_blocks()
    assert eng.memory.stats().in_use > 1
    for r in reqs:
        eng.assert_views_alias(r.request_id, salt=2)
    eng.step()  # decoding: the Mamba group keeps one state slot, earlier ones go back
    mamba_gids = [gid for gid, g in enumerate(layout.groups) if g.kind == "mamba"]
    for r in reqs:
        tables = eng.block_ids(r.request_id)
        assert all(len(tables[g]) == 1 for g in mamba_gids), (tables, mamba_gids)
        eng.assert_views_alias(r.request_id, salt=4)
    eng.assert_pages_follow_blocks()
    eng.run(each=eng.assert_pages_follow_blocks)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert eng.pool.ledger.used() == 1
    assert eng.memory.stats().in_use == 1


def _mamba_align_hit(elastic: bool) -> tuple[Engine, list[int]]:
    """Mamba ``align`` mode (vLLM's Mamba prefix caching): two requests sharing a prompt of
    six blocks; the tokens the second found cached."""
    specs = mamba_hybrid_specs("align")
    eng = Engine(specs, 8 * MiB, caching=True, mamba_cache_mode="align", elastic=elastic)
    block = next(iter(specs.values())).block_size
    prompt = _prompt(21, 6 * block)
    first = eng.add("a", prompt, max_tokens=2)
    eng.run(each=eng.assert_pages_follow_blocks if elastic else None)
    assert first.status == RequestStatus.FINISHED_LENGTH_CAPPED
    eng.add("b", [*prompt, 9], max_tokens=2)
    out = eng.step()
    return eng, [r.num_computed_tokens for r in out.scheduled_new_reqs]


def test_mamba_align_mode_schedules_as_upstream_with_elastic_on() -> None:
    # Without a model runner no Mamba checkpoint is ever committed, so vLLM finds no hit
    # either way (the attention group's blocks are cached); what must hold is that elastic
    # on schedules exactly as upstream and every cached block stays backed.
    upstream, hits_upstream = _mamba_align_hit(elastic=False)
    eng, hits = _mamba_align_hit(elastic=True)
    assert hits == hits_upstream
    hashed = [sum(b.block_hash is not None for b in e.pool.blocks) for e in (eng, upstream)]
    assert hashed[0] == hashed[1] > 0
    eng.run(each=eng.assert_pages_follow_blocks)
    cached = eng.pool.num_cached_free_blocks()
    assert cached == eng.pool.ledger.used() - 1 > 0  # what stays cached stays backed
    assert eng.pool.trim(10**6) == cached
    assert eng.memory.stats().in_use == 1


# -- MLA: DeepSeek latents, a row that needs padding --------------------------------------------


def test_mla_padded_row_pages_follow_blocks() -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=512 + 64, dtype=BF16)
    specs = {f"model.layers.{i}.self_attn": mla for i in range(61)}
    dense = 61 * 16 * 1152  # 1124352 bytes: its exact 2 MiB page would be 61 x 2 MiB
    eng = Engine(specs, 64 * MiB, granularity=2 * MiB)
    assert eng.planned_stride == dense
    plan = eng.memory.layout.plan
    stride = eng.kv.kv_cache_tensors[0].block_stride
    assert stride == plan.row_stride > dense  # the engine core re-strided vLLM's tensors
    assert plan.page_bytes <= 64 * MiB and plan.page_bytes % stride == 0
    assert eng.kv.num_blocks == (64 * MiB // dense) * dense // stride
    view = eng.views["model.layers.60.self_attn"]
    assert view.stride(0) * view.element_size() == stride  # vLLM addresses the padded rows
    (group,) = eng.memory.layout.groups
    assert group.kind == "mla" and group.cell[0].shape == (16, 1, 576)
    reqs = [eng.add(f"d{i}", _prompt(i + 40, 70), max_tokens=10) for i in range(2)]
    eng.step()
    eng.assert_pages_follow_blocks()
    for r in reqs:
        eng.assert_views_alias(r.request_id, salt=3)
    eng.run(each=eng.assert_pages_follow_blocks)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert eng.memory.stats().in_use == 1
    # the worker sees the padded row as exact (no second padding); the padding is small
    assert plan.padding == 0 and 1 - dense / stride < 0.05
