"""Elastic KV with TP x PP > 1: vLLM's real scheduler drives every worker's pages.

The engine core runs in this process exactly as ``EngineCore._initialize_kv_caches`` does it:
vLLM's planner (``get_global_kv_cache_groups``, ``get_kv_cache_configs``) plans one
``KVCacheConfig`` per rank, the patched engine-core seam fills ``KVCacheConfig.kvcore`` from
``elastic_settings`` (which creates the channel directory), the scheduler's config comes from
``generate_scheduler_kv_cache_config`` and the real ``Scheduler`` builds its block pool through
the patch seam. Each rank is a real worker process that sets up vLLM's own model-parallel
groups (gloo) and allocates its KV cache with vLLM's patched ``allocate_kv_cache``, which calls
``elastic_kv_buffer``. Workers are forked, as vLLM's ``MultiprocExecutor`` does by default on
a host without CUDA initialized; the model, its forward pass and vLLM's executor RPC are
absent (each step's output is built here, as vLLM's own scheduler tests do).

What is checked: pages are mapped on every rank as blocks fill (each rank writes the blocks
of every running request through its buffer: on the host backend a write to an unbacked page
kills the worker) and unmapped on every rank when they empty; a worker killed mid-run makes
the scheduler fail-stop with ``PoolFailed`` instead of hanging; ranks that never start make
the engine's connect fail with ``WorkersMissing`` naming them.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

iface = pytest.importorskip("vllm.v1.kv_cache_interface")
if "kvcore" not in getattr(iface.KVCacheConfig, "__dataclass_fields__", {}):
    pytest.skip("vLLM here is not kvcore's fork", allow_module_level=True)
planning = pytest.importorskip(
    "vllm.v1.core.kv_cache_planning",
    reason="needs vLLM 0.33.0's KV cache planner module (0.30.0 has none: it plans in "
    "kv_cache_utils)",
)

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from harness.vllm.scheduler import BLOCK, GRAN, SPEC  # noqa: E402
from harness.vllm.scheduler import step as scheduler_step  # noqa: E402
from kvcore.adapters.config import ElasticConfig  # noqa: E402
from kvcore.adapters.vllm import elastic_settings  # noqa: E402
from kvcore.adapters.vllm.parallel import (  # noqa: E402
    ChannelKVMemory,
    ParallelSettings,
    parallel_settings,
    vllm_rank,
)
from kvcore.adapters.vllm.pool import ElasticBlockPool  # noqa: E402
from kvcore.adapters.vllm.runtime import close_all  # noqa: E402
from kvcore.budget.ledger import GpuLedger  # noqa: E402
from kvcore.errors import (  # noqa: E402
    ChannelError,
    PoolFailed,
    UnsupportedConfiguration,
    WorkersMissing,
)
from kvcore.parallel.channel import WorkerListener  # noqa: E402

LAYERS = 4  # attention layers of the model, split over the PP stages (SPEC: 512 B per block)
LAYOUT = "BLHNC"  # block-outermost: one block id is one row of every layer
# cuda pages are 2 MiB: 16 KV heads of 128 fp16 -> 128 KiB per layer and block, so a 2 MiB page
# holds 4 (PP=1) or 8 (PP=2) blocks and the workload still spans several pages
CUDA_SPEC = iface.FullAttentionSpec(
    block_size=BLOCK, num_kv_heads=16, head_size=128, dtype=torch.float16
)
NUM_BLOCKS = 64
ANSWER_S = 60.0  # a worker's answer to the test; start-up includes gloo and the first import

TOPOLOGIES = [pytest.param(2, 1, id="tp2"), pytest.param(2, 2, id="tp2xpp2")]


# ------------------------------------------------------------------------- the engine core


def vllm_config(tp: int, pp: int, backend: str = "host", **kvcore: Any) -> VllmConfig:
    options: dict[str, Any] = {"backend": backend, **kvcore}
    if backend == "host":
        options["backend_options"] = {"granularity": GRAN}
    cache = CacheConfig(
        block_size=BLOCK,
        cache_dtype="auto",
        enable_prefix_caching=False,
        kvcore_elastic=True,
        kvcore_config=options,
    )
    config = VllmConfig(
        model_config=ModelConfig(
            model="facebook/opt-125m", dtype="float16", seed=42, max_model_len=256
        ),
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_model_len=256,
            enable_chunked_prefill=True,
            async_scheduling=False,
            is_encoder_decoder=False,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp"
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    config.cache_config.kv_cache_layout = LAYOUT
    return config


def plan(config: VllmConfig, stages: tuple[int, ...] = ()) -> tuple[list[Any], Any]:
    """Per-rank KV cache configs with ``kvcore`` settings, and the scheduler's, as
    ``EngineCore._initialize_kv_caches`` makes them (rank = ``pp * tp_size + tp``).
    ``stages``: layers per PP stage (default: ``LAYERS`` split evenly)."""
    par = config.parallel_config
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    stages = stages or (LAYERS // pp,) * pp
    backend = (config.cache_config.kvcore_config or {}).get("backend")
    spec = SPEC if backend == "host" else CUDA_SPEC
    first = [sum(stages[:s]) for s in range(pp)]
    specs = [
        {f"model.layers.{first[s] + i}.self_attn.attn": spec for i in range(stages[s])}
        for s in range(pp)
        for _ in range(tp)
    ]
    register_all_kvcache_specs(config)
    groups = planning.get_global_kv_cache_groups(config, specs)
    row = max(stages) * spec.page_size_bytes
    configs = planning.get_kv_cache_configs(
        config, specs, [(NUM_BLOCKS + 1) * row] * tp * pp, groups
    )
    for kv in configs:
        kv.kvcore = elastic_settings(config, kv)  # the patched engine-core seam
    scheduler_kv = generate_scheduler_kv_cache_config(configs)
    config.cache_config.num_gpu_blocks = scheduler_kv.num_blocks
    return configs, scheduler_kv


def make_scheduler(config: VllmConfig, scheduler_kv: Any) -> Scheduler:
    return Scheduler(
        vllm_config=config,
        kv_cache_config=scheduler_kv,
        block_size=BLOCK,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
    )


def pool_of(scheduler: Scheduler) -> ElasticBlockPool:
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, ElasticBlockPool)
    return pool


_REPORTS_BATCHES = "step_done" in inspect.getsource(Scheduler.update_from_output)


def step(scheduler: Scheduler) -> Any:
    """One scheduler step with a stand-in model output (one token per scheduled request)."""
    out = scheduler_step(scheduler)
    if not _REPORTS_BATCHES:  # a fork built before the batch-fence patch: what it would call
        nonempty = out.total_num_scheduled_tokens > 0  # (no batch overlaps in this loop)
        pool_of(scheduler).step_scheduled(nonempty)
        pool_of(scheduler).step_done(nonempty)
    return out


def request(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=[(7 * i + len(rid)) % 500 + 1 for i in range(prompt)],
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
    )


# ------------------------------------------------------------------------- the workers


def _worker(
    rank: int, config: VllmConfig, kv: Any, port: int, conn: Connection
) -> None:  # pragma: no cover - runs in the worker process
    from vllm.distributed import parallel_state
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvcore.adapters.vllm import parallel

    par = config.parallel_config
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            tp * pp, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo"
        )
        parallel_state.initialize_model_parallel(tp, pp, backend="gloo")
    device = torch.device(config.device_config.device)
    caches = allocate_kv_cache(kv, device, iface.KVCacheLayout[LAYOUT])  # the patched seam
    memory = parallel.worker_memory(kv)
    assert memory is not None and memory.mapper is not None
    buffer = memory.buffer()
    rows = buffer.view(int(kv.num_blocks), -1)
    inside = all(
        buffer.data_ptr() <= t.data_ptr() < buffer.data_ptr() + buffer.numel()
        for t in caches.values()
    )
    # vLLM's warm-up (dummy runs, CUDA graph capture) writes its null block, block 0, before
    # the scheduler exists; on the host backend an unbacked page would kill this process here
    rows[0].fill_(1)
    conn.send(("ready", memory.rank, inside))
    while True:
        op, *args = conn.recv()
        if op == "pages":
            mapped = [
                p for p in range(memory.mapper.num_pages) if memory.mapper.state(p).name == "MAPPED"
            ]
            conn.send(mapped)
        elif op == "write":  # fill these blocks' rows; an unbacked page kills the process
            blocks, value = args
            for b in blocks:
                rows[b].fill_(value)
            if device.type == "cuda":
                torch.cuda.synchronize()
            conn.send(all(int(rows[b][0]) == value for b in blocks))
        elif op == "exit":
            conn.send("bye")
            return


class Workers:
    """One forked process per rank; ``ask(rank, ...)`` talks to its control pipe."""

    def __init__(self, config: VllmConfig, configs: list[Any], method: str = "fork") -> None:
        ctx = mp.get_context(method)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        for rank, kv in enumerate(configs):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, config, kv, port, theirs), daemon=True)
            proc.start()
            self.procs.append(proc)
            self.conns.append(ours)
        self.ranks = [self._answer(r)[1] for r in range(len(configs))]
        self.views_inside = [self._answer(r, first=False) for r in range(len(configs))]

    def _answer(self, rank: int, first: bool = True) -> Any:
        if first:
            conn = self.conns[rank]
            if not conn.poll(ANSWER_S):
                raise TimeoutError(f"worker {rank} did not answer in {ANSWER_S} s")
            self._ready = getattr(self, "_ready", {})
            self._ready[rank] = conn.recv()
            return self._ready[rank]
        return self._ready[rank][2]

    def ask(self, rank: int, *msg: Any) -> Any:
        conn = self.conns[rank]
        conn.send(msg)
        if not conn.poll(ANSWER_S):
            raise TimeoutError(f"worker {rank} did not answer {msg[0]!r} in {ANSWER_S} s")
        return conn.recv()

    def pages(self) -> list[list[int]]:
        return [self.ask(r, "pages") for r in range(len(self.procs))]

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].join(10)

    def close(self) -> None:
        for rank, proc in enumerate(self.procs):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    self.ask(rank, "exit")
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.fixture(autouse=True)
def _collect() -> Iterator[None]:
    yield
    close_all()  # the pools' own memories (the engine core's channel), without waiting for gc


def _engine(tp: int, pp: int, backend: str = "host", method: str = "fork") -> Any:
    config = vllm_config(tp, pp, backend)
    configs, scheduler_kv = plan(config)
    workers = Workers(config, configs, method)
    return config, scheduler_kv, workers


# ------------------------------------------------------------------------- tests


def run_and_check(tp: int, pp: int, backend: str = "host", method: str = "fork") -> None:
    config, scheduler_kv, workers = _engine(tp, pp, backend, method)
    try:
        assert sorted(workers.ranks) == list(range(tp * pp)), "vLLM's ranks, each once"
        assert all(workers.views_inside), "vLLM's layer views lie in kvcore's buffer"
        null_page = [0]  # block 0 is vLLM's null block: backed from the start, stays mapped
        assert workers.pages() == [null_page] * (tp * pp), "backed before the engine connects"
        scheduler = make_scheduler(config, scheduler_kv)
        pool = pool_of(scheduler)
        bpp = pool.ledger.geometry.blocks_per_page
        assert workers.pages() == [null_page] * (tp * pp), "the engine adopted it"

        lengths = [40, 70, 100, 33, 90, 64]
        for i, n in enumerate(lengths):
            scheduler.add_request(request(f"r{i}", n, max_tokens=6 + i))
        seen_pages = 1
        while scheduler.has_requests():
            step(scheduler)
            held = {
                rid: scheduler.kv_cache_manager.get_block_ids(rid)[0]
                for rid in scheduler.requests
                if rid in {r.request_id for r in scheduler.running}
            }
            blocks = sorted({b for ids in held.values() for b in ids})
            want = sorted({0} | {b // bpp for b in blocks})
            assert pool.ledger.pages.flush(10.0)  # background unmaps done: a settled state
            pages = workers.pages()
            # the same pages on every rank, covering every block a running request holds
            assert all(p == pages[0] for p in pages), pages
            assert set(want) <= set(pages[0])
            assert len(pages[0]) == pool.ledger.pages.stats().mapped
            for rank in range(tp * pp):
                assert workers.ask(rank, "write", blocks, rank + 1), rank
            seen_pages = max(seen_pages, len(pages[0]))
        assert seen_pages > 3, "the workload spread over several pages"
        assert pool.ledger.pages.flush(10.0)
        assert workers.pages() == [null_page] * (tp * pp), "emptied pages unmapped everywhere"
        pool.close()  # what the patched Scheduler.shutdown calls: unmapped on every rank
        assert workers.pages() == [[]] * (tp * pp)
    finally:
        workers.close()


@pytest.mark.parametrize(("tp", "pp"), TOPOLOGIES)
def test_pages_follow_blocks_on_every_rank(tp: int, pp: int) -> None:
    run_and_check(tp, pp)


def test_worker_killed_mid_run_fails_stop() -> None:
    config, scheduler_kv, workers = _engine(2, 1)
    try:
        scheduler = make_scheduler(config, scheduler_kv)
        for i in range(3):
            scheduler.add_request(request(f"a{i}", 60, max_tokens=40))
        step(scheduler)
        assert len(workers.pages()[1]) > 1
        workers.kill(1)
        scheduler.add_request(request("late", 200, max_tokens=4))  # needs new pages
        deadline = time.monotonic() + 30
        with pytest.raises(PoolFailed):
            while time.monotonic() < deadline:
                step(scheduler)
        assert time.monotonic() < deadline, "no hang: the failure surfaced at once"
        with pytest.raises(PoolFailed):  # fail-stop: every later transition refuses too
            scheduler.add_request(request("later", 300, max_tokens=4))
            for _ in range(5):
                step(scheduler)
        assert workers.procs[0].is_alive()
    finally:
        workers.close()


def test_gpu_ledger_charges_one_record_per_rank(tmp_path: Path) -> None:
    """Both ranks run on the host backend's device 0 here: one ledger, one record per rank,
    each charged what one rank holds; the pool's close removes both."""
    config = vllm_config(2, 1, gpu_ledger=True, ledger_dir=str(tmp_path))
    configs, scheduler_kv = plan(config)
    workers = Workers(config, configs)
    try:
        scheduler = make_scheduler(config, scheduler_kv)
        pool = pool_of(scheduler)
        for i in range(3):
            scheduler.add_request(request(f"g{i}", 80, max_tokens=3))
        step(scheduler)
        assert pool.ledger.pages.flush(10.0)
        charged = pool.ledger.pages.stats().charged_bytes
        assert charged > 2 * pool.ledger.geometry.page_bytes
        (path,) = [p for p in tmp_path.iterdir() if p.is_file()]
        with GpuLedger.open_path(path) as ledger:
            records = {r.name.rsplit("-", 1)[1]: r.mapped for r in ledger.snapshot().records}
        assert records == {"rank0": charged, "rank1": charged}
        pool.close()
        with GpuLedger.open_path(path) as ledger:
            assert ledger.snapshot().records == ()
    finally:
        workers.close()


def test_missing_workers_time_out_naming_them(tmp_path: Any) -> None:
    """Rank 0 of a TP=2 x PP=2 group serves its socket; ranks 1-3 never start."""
    from kvcore.memory.local_mapper import LocalPageMapper
    from kvcore.memory.virtual_cache import VirtualKVCache
    from kvcore.vmm import open_backend

    config = vllm_config(2, 2)
    configs, scheduler_kv = plan(config)
    parallel = parallel_settings(scheduler_kv.kvcore)
    assert parallel is not None and parallel.world_size == 4
    backend = open_backend("host", 0, granularity=GRAN)
    from kvcore.adapters.vllm.groups import family_layout

    cache = VirtualKVCache(backend, family_layout(configs[0], GRAN).geometry)
    listener = WorkerListener(LocalPageMapper(cache), rank=0, channel_dir=parallel.channel_dir)
    listener.start()
    try:
        started = time.monotonic()
        with pytest.raises(WorkersMissing) as err:
            ChannelKVMemory(
                ElasticConfig(backend="host"),
                parallel,
                num_blocks=int(scheduler_kv.num_blocks),
                block_bytes=cache.geometry.block_bytes,
                connect_timeout=1.0,
            )
        assert err.value.ranks == (1, 2, 3)
        assert "[1, 2, 3]" in str(err.value)
        assert time.monotonic() - started < 10
        assert listener.sessions == 0
    finally:
        listener.close()
        cache.close()
        backend.close()


def test_ranks_whose_pages_disagree_are_refused() -> None:
    """Rank 1 reports pages of twice the bytes (twice the bytes per block): the engine refuses
    to drive them with one block map and closes what it opened."""
    from kvcore.memory.geometry import KVGeometry
    from kvcore.memory.local_mapper import LocalPageMapper
    from kvcore.memory.virtual_cache import VirtualKVCache
    from kvcore.vmm import open_backend

    config = vllm_config(2, 1)
    _, scheduler_kv = plan(config)
    parallel = parallel_settings(scheduler_kv.kvcore)
    assert parallel is not None
    backend = open_backend("host", 0, granularity=GRAN)
    caches = [
        VirtualKVCache(backend, KVGeometry(1, 1, 1024 * k, 64, 4096 * k, GRAN)) for k in (1, 2)
    ]
    listeners = [
        WorkerListener(LocalPageMapper(c), rank=r, channel_dir=parallel.channel_dir).start()
        for r, c in enumerate(caches)
    ]
    try:
        with pytest.raises(ChannelError, match="pages disagree"):
            ChannelKVMemory(
                ElasticConfig(backend="host"),
                parallel,
                num_blocks=64,
                block_bytes=1024,
                connect_timeout=5.0,
            )
        assert all(lst.wait_closed(5) for lst in listeners), "the failed start closed them"
        assert [lst.sessions for lst in listeners] == [1, 1]
    finally:
        for lst in listeners:
            lst.close()
        for c in caches:
            c.close()
        backend.close()


def test_worker_outside_vllm_groups_is_refused() -> None:
    with pytest.raises(UnsupportedConfiguration, match="model-parallel groups"):
        vllm_rank(ParallelSettings("/nonexistent", 2, 2))


def test_unsupported_parallel_setups_refused_at_start() -> None:
    config = vllm_config(2, 1)
    config.parallel_config.distributed_executor_backend = "ray"
    with pytest.raises(UnsupportedConfiguration, match="multiprocessing executor"):
        plan(config)


def test_layer_outermost_layout_refused_at_start() -> None:
    """The worker channel serves block-outermost rows: LBNHC with TP = 2 is refused while
    the engine core plans (patch 0009 resolves BLNHC there unless told otherwise)."""
    config = vllm_config(2, 1)
    config.cache_config.kv_cache_layout = "LBNHC"
    with pytest.raises(UnsupportedConfiguration, match="layer-outermost"):
        plan(config)


def test_uneven_pipeline_stages_refused_at_start() -> None:
    """3 + 1 layers: the stages' block rows differ, so their pages would cover different
    blocks; refused while the engine core plans, before any worker allocates."""
    with pytest.raises(UnsupportedConfiguration, match="pipeline stages"):
        plan(vllm_config(1, 2), stages=(3, 1))


def test_settings_entry_is_validated() -> None:
    assert parallel_settings({"backend": "host"}) is None
    ok = ParallelSettings("/tmp/x", 4, 2)
    assert parallel_settings({"parallel": ok.as_dict()}) == ok
    for bad in ({"world_size": 4}, {**ok.as_dict(), "world_size": 3}):
        with pytest.raises(UnsupportedConfiguration, match="parallel"):
            parallel_settings({"parallel": bad})


@pytest.mark.gpu
@pytest.mark.parametrize(("tp", "pp"), TOPOLOGIES)
def test_pages_follow_blocks_on_every_rank_cuda(tp: int, pp: int) -> None:
    """The same on the cuda backend, every rank on the one GPU (spawned workers: CUDA does
    not survive a fork)."""
    run_and_check(tp, pp, backend="cuda", method="spawn")
