"""vLLM's start-up warm-up on elastic KV (forked wheel, host backend): ``warmup_blocks``.

The warm-up code is the release's own: ``vllm.v1.worker.gpu.warmup._warmup_kernels`` (the V2
runner's scheduler-realistic prefill and decode steps) and ``run_mixed_prefill_decode_warmup``
(``kernel_warmup``'s mixed step) hand-build ``SchedulerOutput``s with block ids 1, 2, 3, ...
and pass them to the worker's ``execute_model``. The KV cache config is a real vLLM
``KVCacheConfig`` whose elastic memory is made through kvcore's own path (``memory_for``, as
the worker's ``allocate_kv_cache`` does) on the host backend, where a store to an unbacked page
faults as on a GPU.

What is checked: inside ``warmup_blocks`` every block id those batches carry lies on the page of
the null block, which is mapped, and every block table keeps its length; a block the ledger has
allocated is never used; nothing is mapped or allocated by the warm-up; the worker's own
``execute_model`` is back after the scope (also when the warm-up raises); a KV cache kvcore
never allocated is refused; and the patched ``Worker.compile_or_warm_up_model`` runs its
warm-up inside the scope exactly when elastic KV is on.

The model runner is a stand-in (``_runner``): vLLM's ``GPUModelRunner`` needs a GPU (CUDA
streams, device tensors, a loaded model) to be built, and the warm-up functions only read a
handful of its attributes. ``execute_model`` / ``sample_tokens`` record what reaches them, as
the forward pass is absent (vLLM's own scheduler tests build outputs the same way).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

iface = pytest.importorskip("vllm.v1.kv_cache_interface")
if "kvcore" not in getattr(iface.KVCacheConfig, "__dataclass_fields__", {}):
    pytest.skip("vLLM here is not kvcore's fork", allow_module_level=True)
warmup = pytest.importorskip(
    "vllm.v1.worker.gpu.warmup", reason="needs the V2 model runner's warm-up module"
)

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

from kvcore.adapters.vllm import memory_for, warmup_blocks  # noqa: E402
from kvcore.adapters.vllm.memory import ElasticKVMemory  # noqa: E402
from kvcore.adapters.vllm.runtime import close_all, existing_memory  # noqa: E402
from kvcore.errors import KvcoreError  # noqa: E402
from kvcore.memory.pages import PageState  # noqa: E402

GRAN = 4096  # host backend granularity: one page
TOKENS = 2  # tokens per block: small, so the decode steps grow block tables (new_block_ids)
# 2 (K, V) * 2 tokens * 1 head * 32 * 4 B = 512 B a block: 8 blocks a page
FULL = FullAttentionSpec(block_size=TOKENS, num_kv_heads=1, head_size=32, dtype=torch.float32)
SWA = SlidingWindowSpec(
    block_size=TOKENS, num_kv_heads=1, head_size=32, dtype=torch.float32, sliding_window=4
)
# 2 * 2 * 1 * 256 * 4 B = 4 KiB a block: the null block's page holds nothing else
WIDE = FullAttentionSpec(block_size=TOKENS, num_kv_heads=1, head_size=256, dtype=torch.float32)
NUM_BLOCKS = 64
MIXED_TOKENS = 9  # run_mixed_prefill_decode_warmup: an 8-token prefill next to a decode

# One recorded batch: (kind, request id, per-group block ids) for each request that hands the
# runner block ids ("new": NewRequestData.block_ids; "cached": CachedRequestData.new_block_ids,
# None where a running request gets no new block).
Entry = tuple[str, str, tuple[tuple[int, ...], ...] | None]


@pytest.fixture(autouse=True)
def _clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KVCORE_LEDGER_DIR", str(tmp_path))  # nothing outside tmp_path
    # the warm-up's last step waits for the device; the CPU build of torch has none
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *_a, **_k: None)
    yield
    close_all()


# ------------------------------------------------------------------ the stand-ins


def _kv_config(*specs: KVCacheSpec, num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """A real vLLM KV cache config, elastic on the host backend (4 KiB pages)."""
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
    )
    kv.kvcore = {"backend": "host", "backend_options": {"granularity": GRAN}}
    return kv


class _Connector:
    def __init__(self) -> None:
        self.disabled: list[bool] = []

    def set_disabled(self, disabled: bool) -> None:
        self.disabled.append(disabled)


def _runner(kv: KVCacheConfig, *, spec_steps: int = 0, max_num_seqs: int = 4) -> Any:
    """The attributes of ``GPUModelRunner`` that vLLM's warm-up functions read (0.30.0 and
    0.33.0), and nothing else: the real runner needs a GPU to be built."""
    return SimpleNamespace(
        vllm_config=SimpleNamespace(is_mm_encoder_only=False, num_lookahead_tokens=spec_steps),
        model_config=SimpleNamespace(get_vocab_size=lambda: 64),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
        kv_cache_config=kv,
        num_speculative_steps=spec_steps,
        decode_query_len=1 + spec_steps,
        speculative_config=None,
        adaptive_verification=None,
        rejection_sampler=None,
        max_model_len=64,
        max_num_reqs=max_num_seqs,
        model_state=SimpleNamespace(),  # no encoder
        is_pooling_model=False,
        is_encoder_decoder=False,
        is_last_pp_rank=True,
        kv_block_zeroer=None,
        kv_connector=_Connector(),
    )


def _entries(scheduler_output: Any) -> list[Entry]:
    """The block ids ``scheduler_output`` hands the model runner, copied as they are now."""

    def groups(ids: Any) -> tuple[tuple[int, ...], ...] | None:
        return None if ids is None else tuple(tuple(g) for g in ids)

    out: list[Entry] = [
        ("new", r.req_id, groups(r.block_ids)) for r in scheduler_output.scheduled_new_reqs
    ]
    cached = scheduler_output.scheduled_cached_reqs
    new_block_ids = cached.new_block_ids or [None] * len(cached.req_ids)
    out += [
        ("cached", rid, groups(ids)) for rid, ids in zip(cached.req_ids, new_block_ids, strict=True)
    ]
    return out


class _Worker:
    """The two methods of vLLM's ``Worker`` that the warm-up calls, recording each batch."""

    def __init__(self, model_runner: Any) -> None:
        self.model_runner = model_runner
        self.batches: list[list[Entry]] = []
        self.samples = 0

    def execute_model(self, scheduler_output: Any) -> None:
        self.batches.append(_entries(scheduler_output))

    def sample_tokens(self, grammar_output: Any) -> None:
        self.samples += 1


def _drive(worker: _Worker) -> None:
    """vLLM's two hand-built warm-ups, given ``worker.execute_model`` as the real worker gives
    ``self.execute_model`` (looked up when the warm-up starts)."""
    runner = worker.model_runner
    warmup._warmup_kernels(runner, worker.execute_model, worker.sample_tokens)
    assert warmup.run_mixed_prefill_decode_warmup(
        runner, worker.execute_model, worker.sample_tokens, MIXED_TOKENS
    )


def _block_ids(batches: list[list[Entry]]) -> list[int]:
    return [b for batch in batches for _, _, gs in batch if gs is not None for g in gs for b in g]


def _shapes(batches: list[list[Entry]]) -> list[list[tuple[str, str, Any]]]:
    """Each batch with its block ids replaced by the block tables' lengths."""
    return [
        [(k, r, None if gs is None else tuple(len(g) for g in gs)) for k, r, gs in batch]
        for batch in batches
    ]


def _own_method_is_back(worker: _Worker) -> bool:
    return "execute_model" not in vars(worker) and (
        worker.execute_model.__func__ is type(worker).execute_model  # type: ignore[attr-defined]
    )


def _pairs(plain: _Worker, folded: _Worker) -> dict[int, int]:
    """Each warm-up block id (unscoped run) -> the id it became inside the scope, asserting
    that the map is a function (the same id always folds to the same block)."""
    mapping: dict[int, int] = {}
    for b, f in zip(_block_ids(plain.batches), _block_ids(folded.batches), strict=True):
        assert mapping.setdefault(b, f) == f, f"block {b} folded to {mapping[b]} and {f}"
    return mapping


# ------------------------------------------------------------------ the warm-up on backed blocks


@pytest.mark.parametrize("spec_steps", [0, 2], ids=["plain", "spec-decode"])
@pytest.mark.parametrize("specs", [(FULL,), (FULL, SWA)], ids=["one-group", "two-groups"])
def test_warm_up_batches_carry_only_blocks_of_the_null_blocks_mapped_page(
    specs: tuple[KVCacheSpec, ...], spec_steps: int
) -> None:
    kv = _kv_config(*specs)
    memory = memory_for(kv)  # the worker's allocate_kv_cache: block 0 reserved, page 0 mapped
    geometry = memory.geometry
    null_page = geometry.page_of(0)
    assert geometry.blocks_per_page == 8
    mapped_before, used_before = memory.stats().in_use, memory.ledger.used()
    assert (mapped_before, used_before) == (1, 1)

    plain = _Worker(_runner(kv, spec_steps=spec_steps))
    _drive(plain)  # upstream behaviour: ids 1, 2, 3, ... on pages nobody mapped
    plain_ids = _block_ids(plain.batches)
    assert any(b not in geometry.blocks_of(null_page) for b in plain_ids)
    assert any(memory.pages.state(geometry.page_of(b)) == PageState.FREE for b in plain_ids)
    assert any(gs is not None for batch in plain.batches for k, _, gs in batch if k == "cached")

    worker = _Worker(_runner(kv, spec_steps=spec_steps))
    with warmup_blocks(worker):
        assert not _own_method_is_back(worker)
        _drive(worker)
    assert _own_method_is_back(worker)

    ids = _block_ids(worker.batches)
    assert ids and {geometry.page_of(b) for b in ids} == {null_page}
    assert memory.pages.state(null_page) == PageState.IN_USE  # mapped, for good
    # same batches, same requests, same block table lengths per request and group
    assert _shapes(worker.batches) == _shapes(plain.batches)
    assert worker.samples == plain.samples
    _pairs(plain, worker)
    # nothing mapped or allocated for the warm-up
    assert memory.stats().in_use == mapped_before and memory.ledger.used() == used_before
    # the folded blocks take stores (on the host backend a store to an unbacked page faults)
    rows = memory.buffer().view(geometry.num_blocks, geometry.block_bytes)
    rows[sorted(set(ids))] = 7
    assert bool((rows[sorted(set(ids))] == 7).all())

    # after the scope the worker's own method runs: vLLM's ids reach it unchanged
    after = _Worker(worker.model_runner)
    worker.batches.clear()
    _drive(worker)
    _drive(after)
    assert worker.batches == plain.batches == after.batches


def test_the_workers_own_execute_model_is_back_when_the_warm_up_raises() -> None:
    class Failing(_Worker):
        def execute_model(self, scheduler_output: Any) -> None:
            super().execute_model(scheduler_output)
            if len(self.batches) == 2:  # the first decode step
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    kv = _kv_config(FULL)
    memory = memory_for(kv)
    worker = Failing(_runner(kv))
    with pytest.raises(RuntimeError, match="illegal memory access"), warmup_blocks(worker):
        _drive(worker)
    assert _own_method_is_back(worker)
    assert len(worker.batches) == 2
    assert {memory.geometry.page_of(b) for b in _block_ids(worker.batches)} == {0}

    worker.batches.clear()  # and the own method no longer folds
    with pytest.raises(RuntimeError):
        _drive(worker)
    assert any(memory.geometry.page_of(b) != 0 for b in _block_ids(worker.batches))

    with pytest.raises(ValueError, match="body"), warmup_blocks(worker):  # any error, any body
        raise ValueError("body")
    assert _own_method_is_back(worker)


# ------------------------------------------------------------------ which blocks it folds onto


def test_a_null_page_holding_only_the_null_block_folds_every_id_to_it() -> None:
    kv = _kv_config(WIDE)
    memory = memory_for(kv)
    assert memory.geometry.blocks_per_page == 1  # a 4 KiB block on a 4 KiB page

    plain = _Worker(_runner(kv))
    _drive(plain)
    assert set(_block_ids(plain.batches)) != {0}
    worker = _Worker(_runner(kv))
    with warmup_blocks(worker):
        _drive(worker)

    assert set(_block_ids(worker.batches)) == {0}
    assert _shapes(worker.batches) == _shapes(plain.batches)
    assert memory.pages.state(0) == PageState.IN_USE
    assert memory.stats().in_use == 1 and memory.ledger.used() == 1


def test_free_blocks_of_the_null_page_are_used_round_robin_never_an_allocated_one() -> None:
    kv = _kv_config(FULL, SWA)
    memory: ElasticKVMemory = memory_for(kv)
    geometry = memory.geometry
    taken = memory.ledger.alloc(1)
    assert taken is not None
    [held] = taken
    assert geometry.page_of(held) == geometry.page_of(0)  # partly used pages fill first
    spare = [b for b in geometry.blocks_of(0) if b not in (0, held)]
    assert len(spare) == geometry.blocks_per_page - 2

    plain = _Worker(_runner(kv))
    _drive(plain)
    worker = _Worker(_runner(kv))
    with warmup_blocks(worker):
        _drive(worker)

    ids = _block_ids(worker.batches)
    assert held not in ids
    assert set(ids) == set(spare)  # more warm-up ids than spare blocks: every one is used
    mapping = _pairs(plain, worker)
    assert 0 not in mapping  # vLLM's warm-up never names the null block itself
    # round robin over the free blocks, in id order: 1 -> spare[0], 2 -> spare[1], ...
    assert all(f == spare[(b - 1) % len(spare)] for b, f in mapping.items())
    assert memory.ledger.is_allocated(held) and memory.ledger.used() == 2
    assert _shapes(worker.batches) == _shapes(plain.batches)


# ------------------------------------------------------------------ refused


def test_a_kv_cache_kvcore_never_allocated_is_refused() -> None:
    kv = _kv_config(FULL)  # elastic settings, but no worker made its memory in this process
    assert existing_memory(kv) is None
    worker = _Worker(_runner(kv))
    with pytest.raises(KvcoreError, match="did not allocate"), warmup_blocks(worker):
        pytest.fail("the scope must not start")
    assert _own_method_is_back(worker)
    assert existing_memory(kv) is None  # and it made none

    memory_for(kv).close()  # a closed memory is no memory either
    with pytest.raises(KvcoreError, match="did not allocate"), warmup_blocks(worker):
        pytest.fail("the scope must not start")
    assert _own_method_is_back(worker) and worker.batches == []


# ------------------------------------------------------------------ the patched worker


@pytest.mark.parametrize("elastic", [True, False], ids=["elastic", "static"])
def test_the_patched_compile_or_warm_up_model_warms_up_inside_the_scope(elastic: bool) -> None:
    from vllm.v1.worker.gpu_worker import Worker

    class Seam(_Worker):
        """``self`` of the patched ``Worker.compile_or_warm_up_model``: its upstream body is
        replaced by vLLM's V2 warm-up call (what it runs with the V2 model runner)."""

        def __init__(self, model_runner: Any) -> None:
            super().__init__(model_runner)
            self.cache_config = SimpleNamespace(kvcore_elastic=elastic)

        def _upstream_compile_or_warm_up_model(self) -> str:
            warmup.warmup_kernels(self.model_runner, self.execute_model, self.sample_tokens)
            return "compilation times"

    kv = _kv_config(FULL)
    memory = memory_for(kv)
    plain = _Worker(_runner(kv))
    warmup.warmup_kernels(plain.model_runner, plain.execute_model, plain.sample_tokens)
    seam = Seam(_runner(kv))

    assert Worker.compile_or_warm_up_model(seam) == "compilation times"  # type: ignore[arg-type]
    assert _own_method_is_back(seam)
    pages = {memory.geometry.page_of(b) for b in _block_ids(seam.batches)}
    assert (pages == {0}) is elastic
    assert _shapes(seam.batches) == _shapes(plain.batches)
    if not elastic:
        assert seam.batches == plain.batches
