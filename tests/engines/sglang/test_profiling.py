"""Memory profiling in elastic mode: SGLang's real ``_profile_available_bytes`` (patched).

The device figures come from kvcore's host backend (its configured ``device_bytes``, and
with shared accounting the memory another backend object holds on the same host "device"),
SGLang's own measurement of free memory is the real one (host RAM on CPU): the elastic
profile must not depend on it, upstream's does.
"""

from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any

import pytest

from kvcore.adapters.config import ElasticConfig
from kvcore.adapters.sglang.profiling import elastic_memory_gb, profile

from .harness import requires_fork

pytestmark = requires_fork

GIB = 1 << 30
DRIFT = 1.5  # GiB: host free memory moving between SGLang's reads and ours (busy machine)


def _host(device_gib: int, **extra: Any) -> dict[str, Any]:
    return {
        "backend": "host",
        "backend_options": {"device_bytes": device_gib * GIB, "granularity": 1 << 16},
        **extra,
    }


class _Sizer:
    """Stands in for a ``KVCacheConfigurator`` *instance* so the real, patched
    ``_profile_available_bytes`` runs: building the real configurator needs a model and a
    distributed runtime. The attributes are the ones the method reads, set to a dense,
    text-only model (no Mamba state, no multimodal reservation)."""

    device = "cpu"
    gpu_id = 0
    mambaish_config = None
    post_capture_kv_active = False
    model_config = SimpleNamespace(is_multimodal=False)


def _profile_bytes(elastic: bool, config: dict[str, Any], pre_gb: float, frac: float) -> int:
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(
        ServerArgs(
            model_path="dummy",
            kvcore_elastic=elastic,
            kvcore_config=config,
            mem_fraction_static=frac,
        )
    )
    from sglang.srt.distributed import parallel_state
    from sglang.srt.model_executor.cuda_graph_config import default_cuda_graph_config
    from sglang.srt.runtime_context import get_exec, get_parallel

    # one rank, no launch: SGLang 0.5.23 reads the launch world from get_parallel() (its
    # group for the CPU group, not used at one rank), 0.5.20 from parallel_state's WORLD
    one = SimpleNamespace(world_size=1, cpu_group=None)
    with ExitStack() as stack:
        try:
            stack.enter_context(get_parallel().override(launch_world_size=1, world_group=one))
        except ValueError:  # no launch_world_size field (0.5.20)
            stack.callback(setattr, parallel_state, "_WORLD", parallel_state._WORLD)
            parallel_state._WORLD = one
        # the graph settings a server resolves at launch
        graphs = {"cuda_graph_config": default_cuda_graph_config()}
        stack.enter_context(get_exec().graph.override(**graphs))
        return int(KVCacheConfigurator._profile_available_bytes(_Sizer(), pre_gb))


def _free_gb() -> float:
    from sglang.srt.utils import get_available_gpu_memory

    return float(get_available_gpu_memory("cpu", 0))


def test_logical_capacity_is_a_fraction_of_the_total_minus_the_footprint() -> None:
    # footprint: SGLang measured 3 GiB less free memory than before the weights loaded
    pre = _free_gb() + 3.0
    got = _profile_bytes(True, _host(80), pre, 0.8) / GIB
    # SGLang measures host RAM here: other processes on the machine move it between reads
    assert got == pytest.approx(0.8 * 80 - 3.0, abs=DRIFT)
    # the device size the backend reports moves it by mem_fraction_static per GiB
    bigger = _profile_bytes(True, _host(100), _free_gb() + 3.0, 0.8) / GIB
    assert bigger - got == pytest.approx(0.8 * 20, abs=2 * DRIFT)


def test_elastic_off_is_upstreams_free_memory_profile() -> None:
    free = _free_gb()
    got = _profile_bytes(False, _host(80), free + 1.0, 0.9) / GIB
    # upstream: free now - pre * (1 - frac): host RAM, not the kvcore device
    assert got == pytest.approx(free - (free + 1.0) * 0.1, abs=DRIFT)
    assert abs(got - (0.9 * 80 - 1.0)) > 2 * DRIFT


def test_memory_another_instance_holds_does_not_shrink_a_new_instance() -> None:
    """A first instance holds device memory (host backend with shared accounting: the same
    count a second backend object sees): the second instance's profile is unchanged, where
    upstream's (free memory) would lose what the first holds."""
    from kvcore.vmm.host import HostBackend

    first = HostBackend(7, device_bytes=8 * GIB, granularity=1 << 20, shared_accounting=True)
    opts = {"device_bytes": 8 * GIB, "granularity": 1 << 20, "shared_accounting": True}
    config = ElasticConfig.parse({"backend": "host", "backend_options": opts})
    try:
        alone = profile(
            config,
            mem_fraction_static=0.5,
            pre_model_load_bytes=8 * GIB,
            available_bytes=7 * GIB,
            device_index=7,
        )
        held = [first.create(1 << 30) for _ in range(3)]
        second = HostBackend(7, device_bytes=8 * GIB, granularity=1 << 20, shared_accounting=True)
        try:
            assert second.mem_info().free == 5 * GIB  # the first instance's 3 GiB are gone
            beside = profile(
                config,
                mem_fraction_static=0.5,
                pre_model_load_bytes=8 * GIB,
                available_bytes=7 * GIB,
                backend=second,
            )
        finally:
            second.close()
        for h in held:
            first.release(h)
    finally:
        first.close()
    assert alone.logical == beside.logical == 4 * GIB - 1 * GIB
    assert alone.physical == beside.physical == 8 * GIB


@pytest.mark.parametrize(
    ("held_gib", "extra", "warned"),
    [(4, {}, True), (2, {}, False), (4, {"limit_bytes": 2 * GIB}, False)],
    ids=["shared", "alone", "budget"],
)
def test_an_unbudgeted_pool_on_a_shared_gpu_is_warned_about(
    caplog: pytest.LogCaptureFixture, held_gib: int, extra: dict[str, Any], warned: bool
) -> None:
    """Another process holds ``held_gib`` of the device (host backend, shared accounting)
    when this server profiles; the server's own 1 GiB footprint is not on the host device,
    so it counts 1 GiB less outside itself. Above 2 GiB and without a budget the start-up
    log says the pool's growth is uncoordinated and names the settings; with a budget, or
    alone, it says nothing."""
    import logging

    from kvcore.vmm.host import HostBackend

    opts = {"device_bytes": 8 * GIB, "granularity": 1 << 20, "shared_accounting": True}
    other = HostBackend(9, device_bytes=8 * GIB, granularity=1 << 20, shared_accounting=True)
    caplog.set_level(logging.WARNING, logger="kvcore.adapters.sglang.profiling")
    try:
        held = [other.create(1 << 30) for _ in range(held_gib)]
        elastic_memory_gb(
            {"backend": "host", "backend_options": opts, **extra},
            pre_model_load_gb=8.0,
            available_gb=7.0,  # this server's own 1 GiB, held nowhere on the host device
            device_index=9,
            mem_fraction_static=0.5,
            cpu_group=None,
        )
        for h in held:
            other.release(h)
    finally:
        other.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if not warned:
        assert lines == []
        return
    (line,) = lines
    assert line.startswith("kvcore: 3.00 GiB of this GPU are held outside this server")
    assert "gpu_ledger" in line and "limit_bytes" in line


@pytest.mark.parametrize(
    ("extra", "physical"),
    [({}, 64), ({"limit_bytes": 24 * GIB}, 24), ({"gpu_ledger": True}, 40)],
    ids=["device", "limit", "ledger-budget"],
)
def test_physical_capacity(tmp_path: Any, extra: dict[str, Any], physical: int) -> None:
    from kvcore.budget.ledger import GpuLedger
    from kvcore.vmm.host import HostBackend

    config = ElasticConfig.parse(_host(64, ledger_dir=str(tmp_path), **extra))
    uuid = HostBackend(0, device_bytes=64 * GIB).device_uuid()
    ledger = GpuLedger.open(uuid, device_total=64 * GIB, directory=tmp_path)
    try:
        ledger.set_budget(40 * GIB)
    finally:
        ledger.close()
    p = profile(config, mem_fraction_static=0.9, pre_model_load_bytes=0, available_bytes=0)
    assert p.physical == physical * GIB
    assert p.logical == int(0.9 * 64 * GIB)  # the budget bounds mapping, not the range


def test_a_footprint_above_the_fraction_keeps_upstreams_error() -> None:
    pre = _free_gb() + 50.0  # the weights took 50 GiB of an 8 GiB device's 0.8
    with pytest.raises(ValueError, match="--mem-fraction-static"):
        _profile_bytes(True, _host(8), pre, 0.8)


def _ranks_profile(rank: int, world: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        # rank 1: a smaller device and a larger footprint
        device_gib, footprint = (80, 2.0) if rank == 0 else (64, 5.0)
        avail, pre = elastic_memory_gb(
            _host(device_gib),
            pre_model_load_gb=10.0 + footprint,
            available_gb=10.0,
            mem_fraction_static=0.8,
            cpu_group=dist.group.WORLD,
        )
        out.put((rank, avail - pre * (1 - 0.8), pre))
    finally:
        dist.destroy_process_group()


def test_the_profile_is_the_minimum_over_ranks() -> None:
    """Two real processes in a gloo group: both get the least logical capacity."""
    import torch.multiprocessing as mp

    from .test_tp_agreement import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ranks_profile, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (logical, pre)) for r, logical, pre in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    expected = min(0.8 * 80 - 2.0, 0.8 * 64 - 5.0)  # rank 1's
    for logical, pre in results.values():
        assert logical == pytest.approx(expected, abs=1e-6)
        assert pre == pytest.approx(64.0)
