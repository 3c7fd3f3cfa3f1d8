"""The real SGLang pool and allocators on a CUDA GPU, elastic off and on (``gpu`` marker).

On the GPU SGLang's paged allocator lays tokens out with its Triton kernels (the CPU runs
take a Python path on 0.5.23 and skip these on 0.5.20) and the pool writes K/V with its own
store kernels into kvcore's virtual tensors on the ``cuda`` backend. What must hold there:
every live token's K/V survives while other requests' pages are unmapped and new ones mapped
(stable addresses, no page of a live block touched), and a physical page freed by SGLang
(request finished, radix eviction) is unmapped once the free reaches the ledger (at once,
or for ids freed without a device wait, at the scheduler's next iteration once the device
has caught up) and its memory goes back to the driver, except what the mapper's bounded
handle pool keeps for the next map (4 pages by default, charged to the instance);
``PageAllocator.trim()`` releases that too. Checked against the driver's own free-memory
figure, less what torch's caching allocator took. ``off`` runs the same scenario on SGLang's
own buffers, which shows the scenario is sound.

The GPU machine has no SGLang install: ``benchmarks/sglang_bundle.py`` carries it there and
``benchmarks/sglang_device.sh run`` runs these (``docs/benchmarks.md``).
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
import torch

pytest.importorskip(
    "sglang", reason="SGLang is not installed here (benchmarks/sglang_device.sh carries it)"
)

from .harness import Engine, requires_fork

pytestmark = [pytest.mark.gpu, requires_fork]

# MHA, 2 layers x K/V, 8 heads x 128 dims, bf16: 2 KiB a token row, 32 KiB a 16-token SGLang
# page; a 2 MiB CUDA page holds 64 SGLang pages (1024 tokens) of one layer's K or V.
HEADS, HEAD_DIM = 8, 128
GPU = {"device": "cuda", "size": 16384, "page_size": 16, "layers": 2, "heads": HEADS}
GPU["head_dim"] = HEAD_DIM
MIB = 1 << 20


def _on_device() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


class KVModel:
    """What every live request's tokens must read back: random K/V per token and layer,
    written through the pool's own ``set_kv_buffer``."""

    def __init__(self, e: Engine, layers: int) -> None:
        self.e, self.layers = e, layers
        self.rows: dict[int, tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = {}
        self.gen = torch.Generator(device="cuda").manual_seed(0)

    def write(self, rid: int, loc: torch.Tensor) -> None:
        n = loc.numel()
        shape = (n, HEADS, HEAD_DIM)
        ks = [torch.randn(shape, generator=self.gen, device="cuda").bfloat16() for _ in range(2)]
        vs = [torch.randn(shape, generator=self.gen, device="cuda").bfloat16() for _ in range(2)]
        for layer in range(self.layers):
            self.e.pool.set_kv_buffer(None, loc, ks[layer], vs[layer], layer_id_override=layer)
        if rid in self.rows:
            old_loc, old_k, old_v = self.rows[rid]
            loc = torch.cat([old_loc, loc])
            ks = [torch.cat([a, b]) for a, b in zip(old_k, ks, strict=True)]
            vs = [torch.cat([a, b]) for a, b in zip(old_v, vs, strict=True)]
        self.rows[rid] = (loc, ks, vs)

    def last(self, rid: int) -> int:
        return int(self.rows[rid][0][-1])

    def check(self) -> None:
        torch.cuda.synchronize()
        for rid, (loc, ks, vs) in self.rows.items():
            for layer in range(self.layers):
                k = self.e.pool.get_key_buffer(layer)[loc]
                v = self.e.pool.get_value_buffer(layer)[loc]
                assert torch.equal(k, ks[layer]), f"request {rid} layer {layer}: K changed"
                assert torch.equal(v, vs[layer]), f"request {rid} layer {layer}: V changed"

    def drop(self, rid: int) -> torch.Tensor:
        return self.rows.pop(rid)[0]


def _extend(a: Any, lens: list[int], prefix: list[int], last: list[int]) -> list[torch.Tensor]:
    p = torch.tensor(prefix, dtype=torch.int64)
    s = torch.tensor(lens, dtype=torch.int64)
    n = int((s - p).sum())
    out = a.alloc_extend(p.cuda(), p, s.cuda(), s, torch.tensor(last).cuda(), n)
    assert out is not None and out.numel() == n and out.is_cuda
    return list(torch.split(out, (s - p).tolist()))


def _driver_free() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _next_iteration(a: Any) -> None:
    """Once the device has caught up, the scheduler's next iteration (``kvcore_step``)
    hands the frees still on their way from the device to the ledger."""
    torch.cuda.synchronize()
    a.kvcore_step()
    assert a._pending.count == 0


def _settled_pages(e: Engine) -> Any:
    return e.pages() if e.mode == "on" else None


class DriverMemory:
    """Bytes the driver reports free, less what torch's caching allocator reserved since."""

    def __init__(self) -> None:
        self.free, self.cached = _driver_free(), torch.cuda.memory_reserved()

    def grown(self) -> int:
        return _driver_free() - self.free + (torch.cuda.memory_reserved() - self.cached)


def _check_returned(e: Engine, before: Any, driver: DriverMemory) -> int:
    """Pages unmapped since ``before``: their bytes are back with the driver except the
    ones the handle pool kept; after ``trim()`` all of them are. Returns the count."""
    after = e.pages()
    unmapped = before.mapped - after.mapped
    kept = after.pooled - before.pooled
    assert 0 <= kept <= unmapped
    assert driver.grown() == (unmapped - kept) * after.page_bytes, (driver.grown() / MIB, after)
    e.manager.pages.trim()
    e.manager.pages.flush()
    assert e.pages().pooled == 0
    assert driver.grown() == unmapped * after.page_bytes + before.pooled * after.page_bytes
    return unmapped


@pytest.mark.parametrize("mode", ["off", "on"])
def test_live_kv_survives_unmapping_and_freed_pages_return_to_the_driver(
    mode: str, make: Any
) -> None:
    _on_device()
    e = make(mode, **GPU, reserve_max=0)
    a = e.allocator
    kv = KVModel(e, layers=2)
    _extend(a, [64], [0], [-1])  # warm SGLang's Triton kernels and torch's allocator

    lens = [3000, 4000, 1000]  # the middle request owns at least 2 whole 1024-token pages
    for rid, loc in enumerate(_extend(a, lens, [0, 0, 0], [-1, -1, -1])):
        kv.write(rid, loc)
    for _ in range(40):  # decode: one token per request per step
        seq = torch.tensor([len(kv.rows[r][0]) + 1 for r in range(3)], dtype=torch.int64)
        last = torch.tensor([kv.last(r) for r in range(3)], dtype=torch.int64)
        new = a.alloc_decode(seq.cuda(), seq, last.cuda())
        assert new is not None and new.numel() == 3
        for rid in range(3):
            kv.write(rid, new[rid : rid + 1])
    kv.check()

    before, driver = _settled_pages(e), DriverMemory()
    a.free(kv.drop(1))  # the 4040-token request finishes
    if mode == "on":
        assert _check_returned(e, before, driver) >= 2
    kv.check()  # the other requests' pages were not touched

    (loc,) = _extend(a, [4000], [0], [-1])  # maps pages again, reuses partly used ones
    kv.write(3, loc)
    kv.check()
    for rid in list(kv.rows):
        a.free(kv.drop(rid))
    if mode == "on":
        end = e.pages()
        assert end.in_use == 1 and end.mapped == 1  # block 0's page only


def test_radix_eviction_on_the_gpu_returns_pages_to_the_driver(make: Any) -> None:
    _on_device()
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    e = make("on", **GPU, reserve_max=0)
    a = e.allocator
    req_pool = ReqToTokenPool(
        size=8, max_context_len=8192, device="cuda", enable_memory_saver=False
    )
    tree = RadixCache(
        CacheInitParams(
            disable=False, req_to_token_pool=req_pool, token_to_kv_pool_allocator=a, page_size=16
        )
    )
    (loc,) = _extend(a, [4096], [0], [-1])
    tree.insert(InsertParams(key=RadixKey(token_ids=array("q", range(4096))), value=loc))
    cached, driver = e.pages(), DriverMemory()
    assert cached.in_use >= 5  # 4096 cached tokens keep their pages (plus block 0's)
    assert tree.evict(EvictParams(num_tokens=4096)).num_tokens_evicted == 4096
    _next_iteration(a)
    assert e.pages().in_use == 1
    assert _check_returned(e, cached, driver) == cached.mapped - 1


def test_token_allocator_on_the_gpu_hands_out_device_ids_and_releases_pages(make: Any) -> None:
    """``page_size == 1`` (SGLang's default): ``alloc`` returns ids built on the device from
    the ledger's runs (no host copy); freeing a request unmaps the pages it owned alone and
    leaves every other request's K/V as written."""
    _on_device()
    e = make("on", **{**GPU, "page_size": 1}, reserve_max=0)
    a = e.allocator
    kv = KVModel(e, layers=2)
    for rid, n in enumerate([1500, 3000, 700]):
        loc = a.alloc(n)
        assert loc is not None and loc.is_cuda and loc.numel() == n
        kv.write(rid, loc)
    owned = kv.rows[1][0]
    assert len(set(owned.tolist())) == 3000 and 0 not in owned.tolist()
    kv.check()
    before, driver = e.pages(), DriverMemory()
    available = a.available_size()
    a.free(kv.drop(1))
    # on its way from the device (``PendingFrees``), free for SGLang at once
    assert a._pending.count == 3000 and a.available_size() == available + 3000
    _next_iteration(a)
    assert _check_returned(e, before, driver) >= 1  # 3000 tokens own at least 1 page alone
    kv.check()
    loc = a.alloc(2000)
    kv.write(3, loc)
    kv.check()


def test_freed_ids_reach_the_host_through_pinned_memory() -> None:
    """``PendingFrees`` on CUDA: the ids a free hands to the ledger were copied into pinned
    host memory (a copy into pageable memory would wait for the work on the stream) and are
    the ids freed, as int64, whatever the freed tensor's dtype."""
    _on_device()
    from kvcore.adapters.sglang.release import PendingFrees

    released: list[torch.Tensor] = []
    pending = PendingFrees(released.append, on_device=True)
    ids = torch.randperm(5000, device="cuda", dtype=torch.int64)[:3000].to(torch.int32)
    freed = ids.tolist()
    pending.add(ids)
    ids.fill_(-1)  # the caller may reuse its tensor once it has freed it
    assert pending.settle(wait=True) == 3000
    (host,) = released
    assert host.device.type == "cpu" and host.is_pinned() and host.dtype == torch.int64
    assert host.tolist() == freed


def test_staged_ids_are_copied_before_their_slice_is_written_again() -> None:
    """``PinnedStaging`` on CUDA with the stream busy (a sleep kernel queued before every
    copy): each id list written into the pinned buffer reaches the device as written,
    though the small halves are switched at every list and written again while the
    copies wait behind the sleep."""
    _on_device()
    from kvcore.adapters.sglang.staging import PinnedStaging

    staging = PinnedStaging("cuda", half=64)
    torch.cuda._sleep(50_000_000)  # tens of milliseconds of device time before the copies
    lists = [array("q", range(k * 100, k * 100 + 40)) for k in range(12)]
    out = [staging.to_device(ids) for ids in lists]
    torch.cuda.synchronize()
    assert [t.tolist() for t in out] == [list(ids) for ids in lists]
