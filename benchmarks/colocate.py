"""Co-location demo: two (or three) vLLM engine cores, one memory budget, elastic vs static.

    nox -s demo                                   # the way to run it (builds its own venv)
    python -m benchmarks.colocate [--seed 0] [--instances 2] [--steps 3000] [--trace F] [--out D]

What runs. Each instance is its own process holding vLLM 0.33.0's **real** v1 ``Scheduler``
(``vllm.v1.core.sched.scheduler``) with its real ``KVCacheManager``, coordinator and block
pool, configured as for a Llama-3-8B-shaped model (32 layers, 8 KV heads of 128, bf16, 16-token
blocks: 2 MiB of KV per block, 128 KiB per token), chunked prefill with an 8192-token budget,
``max_num_seqs=128``, prefix caching off (the prompts are unique: nothing to share). Two modes:

* **elastic** — the forked wheel's ``--kvcore-elastic`` path (``CacheConfig.kvcore_elastic``,
  ``KVCacheConfig.kvcore`` from ``kvcore.adapters.vllm.elastic_settings``): the coordinator
  builds kvcore's ``ElasticBlockPool`` over a ``BlockLedger`` / ``PageAllocator`` /
  ``VirtualKVCache`` on the ``host`` VMM backend (real ``mmap`` reserve/map/unmap of lazily
  allocated ``memfd`` pages). Every instance plans the *whole* budget as its virtual capacity;
  its page allocator is gated by a ``LedgerGate`` registered in one per-GPU ledger (a private
  directory, ``KVCORE_LEDGER_DIR``) whose GPU-wide budget is ``--budget-gib``. A page freed by
  one instance can be mapped by another. Pages freed during a step are reused within it and
  go back to the ledger at the step's end (``_StepReleaseGate`` says why; ``--async-release``
  runs kvcore's defaults through the adapter's own ``gpu_ledger`` option instead).
* **static** — upstream behaviour (elastic off, vLLM's own ``BlockPool``): each instance gets a
  fixed ``num_gpu_blocks`` of ``budget / instances``, reserved for its whole life, as an even
  ``gpu_memory_utilization`` split does.

What is stood in (nothing else is): the model executor. ``_StandInExecutor`` turns each
``SchedulerOutput`` into the ``ModelRunnerOutput`` a GPU model runner would return, the way
vLLM's own ``tests/v1/core`` build them: one sampled token (a fixed id; requests run with
``ignore_eos`` to their ``max_tokens``) for every scheduled request whose prompt (or, after a
preemption, its recomputed prefix) is fully computed this step, none for a partial prefill
chunk; no logprobs, no pooler output, no KV connector. No model is loaded, no attention runs,
no KV bytes are written (the host pages stay untouched, so the demo costs no RAM). The API
server, tokenizer, detokenizer and ``EngineCore`` busy loop are not run either: the parent
process plays the engine core's loop (add requests, ``schedule``, execute, ``update_from_output``).

Workload. From ``--seed`` (numpy PCG64): each instance gets ``--bursts`` bursts of about
``--burst-size`` requests (Poisson), arriving over ``--burst-spread`` steps; instance ``i``'s
bursts are offset by ``i / instances`` of the burst period, so the bursts are staggered and
partly overlap. Prompt lengths are lognormal (median ``--prompt-median`` tokens, sigma 0.9,
clipped to 16..8192), output lengths geometric (mean ``--output-mean``, clipped to 1..2048);
a light Poisson trickle runs between bursts. ``--trace FILE`` replays a JSON-lines file instead
(``{"step": 0, "instance": 0, "prompt_tokens": 812, "output_tokens": 133}`` per line); the
workload used is always written to ``<out>/trace.jsonl``, so a run can be replayed exactly.

Determinism. A scheduler's decisions depend only on the sequence of calls it receives (no wall
clock enters them), so the instances run in lock-step rounds driven by the parent: in round
``t`` every instance, one at a time, adds its arrivals of step ``t``, schedules, executes and
updates, then waits for its page allocator's background thread to settle (``flush``: freed
pages are unmapped and released to the ledger) before it replies; only then does the next
instance step. The order rotates each round so no instance always has first pick of freed
pages. The only shared state (the ledger's budget) is therefore read and written in the same
order every run: the same seed gives the same table and plot, whatever the machine's timing.
The ledger gates read a virtual clock (``ROUND_S`` per round) for the same reason: an instance
below its share that waits for memory is marked for a number of rounds, not of seconds.

Measured, per instance and mode: requests finished within ``--steps`` rounds (of those that
arrived), decode tokens produced, preemptions (``SchedulerOutput.preempted_req_ids``), steps a
request waited in the queue before it was first scheduled (the TTFT proxy: mean and p99; a
request still waiting at the end counts its wait so far), and peak KV memory held (elastic: the
bytes the ledger charges the instance: mapped pages plus the mapper's pooled handles; static:
its fixed share). Printed as a table; a PNG of memory per instance over time for both modes
and a JSON of every figure go to ``--out`` (default ``build/colocate/``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from kvcore.budget.ledger_file import DIR_ENV

GiB = 1 << 30
BLOCK_TOKENS = 16
# Llama-3-8B's KV shape: 32 layers x K,V x 8 heads x 128 x bf16 = 128 KiB per token.
NUM_LAYERS = 32
KV_HEADS = 8
HEAD_SIZE = 128
BLOCK_BYTES = NUM_LAYERS * 2 * KV_HEADS * HEAD_SIZE * 2 * BLOCK_TOKENS  # 2 MiB
MAX_PROMPT = 8192
MAX_OUTPUT = 2048
MAX_MODEL_LEN = 16384
MODES = ("elastic", "static")
ROUND_S = 0.02
"""Virtual seconds per lock-step round: the clock the elastic instances' ledger gates read
(a GPU decode step's order of magnitude), so that the waiting marks of budget shares
(``kvcore.budget.shares``: held 1 s, renewed at most every 0.25 s) last the same rounds in
every run, whatever the machine's speed."""
_STAND_IN_TOKEN = 1000  # the token id the stand-in executor "samples"

_MODEL_CONFIG = {  # config.json of a Llama-3-8B-shaped model; no weights are ever read
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": NUM_LAYERS,
    "max_position_embeddings": MAX_MODEL_LEN,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


# ------------------------------------------------------------------------------ workload


@dataclass(frozen=True)
class Arrival:
    """One request: it reaches instance ``instance`` at round ``step``."""

    step: int
    instance: int
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of the generated bursty workload (module docstring)."""

    seed: int = 0
    instances: int = 2
    steps: int = 3000
    bursts: int = 3
    burst_size: float = 128.0
    burst_spread: int = 60
    prompt_median: float = 700.0
    prompt_sigma: float = 0.9
    output_mean: float = 220.0
    trickle_per_step: float = 0.01


def bursty_workload(spec: WorkloadSpec) -> list[Arrival]:
    """The arrivals of ``spec``, sorted by (step, instance); a pure function of ``spec``.

    Arrivals fall in the first 70% of ``spec.steps`` so the last burst can drain."""
    rng = np.random.default_rng(spec.seed)
    window = max(int(spec.steps * 0.7), 1)
    period = window / max(spec.bursts, 1)
    out: list[Arrival] = []

    def lengths(n: int) -> tuple[np.ndarray, np.ndarray]:
        prompt = rng.lognormal(math.log(spec.prompt_median), spec.prompt_sigma, n)
        output = rng.geometric(1.0 / max(spec.output_mean, 1.0), n)
        return (
            np.clip(np.rint(prompt), 16, MAX_PROMPT).astype(int),
            np.clip(output, 1, MAX_OUTPUT).astype(int),
        )

    for inst in range(spec.instances):
        for burst in range(spec.bursts):
            start = (burst + inst / spec.instances) * period
            n = int(rng.poisson(spec.burst_size))
            steps = start + rng.uniform(0, spec.burst_spread, n)
            prompts, outputs = lengths(n)
            out += [
                Arrival(int(s), inst, int(p), int(o))
                for s, p, o in zip(steps, prompts, outputs, strict=True)
            ]
        n = int(rng.poisson(spec.trickle_per_step * window))
        steps = rng.uniform(0, window, n)
        prompts, outputs = lengths(n)
        out += [
            Arrival(int(s), inst, int(p), int(o))
            for s, p, o in zip(steps, prompts, outputs, strict=True)
        ]
    out = [a for a in out if a.step < spec.steps]
    out.sort(key=lambda a: (a.step, a.instance))
    return out


def read_trace(path: Path) -> list[Arrival]:
    """Arrivals from a JSON-lines trace (one object per line, the ``Arrival`` fields).

    Raises ``ValueError`` naming the line of a malformed record."""
    out: list[Arrival] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            arrival = Arrival(
                int(rec["step"]),
                int(rec["instance"]),
                int(rec["prompt_tokens"]),
                int(rec["output_tokens"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: not a trace record ({exc!r}): {line!r}") from None
        if arrival.step < 0 or arrival.instance < 0:
            raise ValueError(f"{path}:{lineno}: negative step or instance")
        if not (1 <= arrival.prompt_tokens <= MAX_PROMPT and arrival.output_tokens >= 1):
            raise ValueError(f"{path}:{lineno}: prompt_tokens must be 1..{MAX_PROMPT}")
        out.append(
            dataclasses.replace(arrival, output_tokens=min(arrival.output_tokens, MAX_OUTPUT))
        )
    out.sort(key=lambda a: (a.step, a.instance))
    return out


def write_trace(arrivals: Sequence[Arrival], path: Path) -> None:
    """Write ``arrivals`` in ``read_trace``'s format."""
    path.write_text("".join(json.dumps(dataclasses.asdict(a)) + "\n" for a in arrivals))


# ------------------------------------------------------------------------------ one instance


@dataclass(frozen=True)
class InstanceSpec:
    """What an instance process needs to build its scheduler (picklable)."""

    index: int
    mode: str
    num_blocks: int
    model_dir: str
    ledger_dir: str
    device_uuid: str
    log_path: str
    step_release: bool = True
    """Pages freed in a step return to the ledger at its end (``_StepReleaseGate``); else
    kvcore's default: the background thread unmaps them as soon as they are free."""


@dataclass
class StepSample:
    """One instance after one round."""

    held_bytes: int
    """KV memory the instance holds (elastic: charged to the ledger; static: its share)."""
    used_bytes: int
    """Bytes of the blocks allocated to requests (the null block excluded)."""
    preempted: int
    tokens: int


@dataclass
class RequestRecord:
    """One request's life in rounds: arrival, first scheduled, finished (``None``: not
    yet), and how often it was preempted."""

    arrival: int
    first_scheduled: int | None = None
    finished: int | None = None
    preemptions: int = 0


class _StandInExecutor:
    """The model executor's stand-in (module docstring): a ``SchedulerOutput`` in, the
    ``ModelRunnerOutput`` a model runner would return out, without computing anything."""

    def __init__(self, scheduler: Any) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        self._scheduler = scheduler
        self._output_cls = ModelRunnerOutput

    def execute(self, scheduler_output: Any) -> Any:
        requests = self._scheduler.requests
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = requests[req_id]
            # schedule() has already advanced num_computed_tokens by this step's tokens: a
            # request is sampled once everything it holds is computed (not mid-prefill)
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([_STAND_IN_TOKEN] if done else [])
        return self._output_cls(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )


class _StepReleaseGate:
    """The ledger gate as the demo's page allocators see it: ``LedgerGate`` in every respect
    but ``reserve_target``, which always grants the reserve asked for.

    Why: with kvcore's default (no reserve) a page freed during a step is unmapped by the
    allocator's background thread while the scheduler thread may already want a page again
    in the same step (a preemption frees blocks, then the scheduler allocates). Under a full
    budget that race makes ``ElasticBlockPool.get_new_blocks`` count a queued page as free,
    miss it once the background thread has taken it (before patch 0004's ``claim_blocks``
    this raised ``ElasticMiss`` out of ``Scheduler.schedule``; now the request waits); it
    also makes the run depend on thread timing. Here every
    page freed in a step waits in the reserve (mapped, charged to the ledger), is reused
    synchronously within the step, and ``trim`` + ``flush`` at the step's end return it to
    the ledger: between steps an instance holds exactly the pages of its blocks in use."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def try_acquire(self, nbytes: int) -> bool:
        return bool(self._inner.try_acquire(nbytes))

    def release(self, nbytes: int) -> None:
        self._inner.release(nbytes)

    def report_reserve(self, nbytes: int) -> None:
        self._inner.report_reserve(nbytes)

    def reserve_target(self, wanted: int) -> int:
        return wanted

    def headroom(self) -> int:
        return int(self._inner.headroom())

    def overage(self) -> int:
        return int(self._inner.overage())

    def held_back(self) -> bool:
        return bool(self._inner.held_back())

    def note_wanted(self, nbytes: int) -> None:
        self._inner.note_wanted(nbytes)

    def close(self) -> None:
        self._inner.close()


class _Instance:
    """One engine core: vLLM's real scheduler and KV-cache manager, the stand-in executor,
    and (elastic) kvcore's memory registered in the shared ledger."""

    def __init__(self, spec: InstanceSpec) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.spec = spec
        self.elastic = spec.mode == "elastic"
        model = ModelConfig(
            model=spec.model_dir,
            dtype="bfloat16",
            seed=0,
            skip_tokenizer_init=True,
            max_model_len=MAX_MODEL_LEN,
        )
        sched = SchedulerConfig(
            max_num_seqs=128,
            max_num_batched_tokens=8192,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            watermark=0.0,
        )
        cache = CacheConfig(
            block_size=BLOCK_TOKENS,
            gpu_memory_utilization=0.9,
            cache_dtype="auto",
            enable_prefix_caching=False,
        )
        if self.elastic:
            cache.kvcore_elastic = True
            cache.kvcore_config = {
                "backend": "host",
                "backend_options": {"device_bytes": 1 << 40},  # the ledger is the limit
            }
            if spec.step_release:  # pages freed in a step wait in the reserve until its end
                cache.kvcore_config["reserve_max"] = spec.num_blocks
            else:  # the adapter's own ledger gate, kvcore's defaults
                cache.kvcore_config.update(gpu_ledger=True, ledger_dir=spec.ledger_dir)
        config = VllmConfig(
            scheduler_config=sched,
            model_config=model,
            cache_config=cache,
            parallel_config=ParallelConfig(),
        )
        layer_spec = FullAttentionSpec(
            block_size=BLOCK_TOKENS,
            num_kv_heads=KV_HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.bfloat16,
        )
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
        self.kv_config = KVCacheConfig(
            num_blocks=spec.num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layers, layer_spec)],
        )
        cache.num_gpu_blocks = spec.num_blocks
        register_all_kvcache_specs(config)
        self.memory: Any = None
        self._ledger: Any = None
        self._round = 0
        if self.elastic:
            from kvcore.adapters.vllm import elastic_settings, memory_for
            from kvcore.budget.ledger import GpuLedger

            # the shared ledger: where this instance's held bytes are read (_memory)
            self._ledger = GpuLedger.open(spec.device_uuid, directory=Path(spec.ledger_dir))
            self.kv_config.kvcore = elastic_settings(config, self.kv_config)
            # As in a real engine core: the KV memory exists (the worker allocated its
            # buffer) before the scheduler's block pool is built, which takes its ledger.
            gate = self._step_release_gate() if spec.step_release else None
            self.memory = memory_for(self.kv_config, gate=gate)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=self.kv_config,
            block_size=BLOCK_TOKENS,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
        )
        if self.memory is not None:
            pool = self.scheduler.kv_cache_manager.block_pool
            if pool.ledger is not self.memory.ledger:
                raise RuntimeError(
                    "colocate demo: the elastic block pool did not take this process's KV "
                    "memory (kvcore.adapters.vllm.runtime no longer shares it as expected)"
                )
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)
        self.executor = _StandInExecutor(self.scheduler)
        self.records: dict[str, RequestRecord] = {}

    def _step_release_gate(self) -> _StepReleaseGate:
        """``_StepReleaseGate`` over this instance's record in the shared ledger, handed to
        the adapter through ``memory_for(..., gate=)`` (the adapter's ``gpu_ledger`` option
        registers a plain ``LedgerGate``: what ``--async-release`` runs)."""
        import vllm

        from kvcore.budget.ledger_gate import LedgerGate

        gate = LedgerGate(
            self._ledger,
            name=f"demo-{self.spec.index}",
            engine="vllm",
            engine_version=str(vllm.__version__),
            model="llama-3-8b-shaped",
            clock=self._round_clock,
            wall_clock=self._round_clock,
        )
        return _StepReleaseGate(gate)

    def _round_clock(self) -> float:
        """Seconds of the demo's virtual time (``ROUND_S`` per round), the clock of this
        instance's ledger gate: every instance reads the same time in the same round."""
        return 1.0 + self._round * ROUND_S

    def step(self, t: int, arrivals: Sequence[tuple[str, int, int]]) -> StepSample:
        """One round: add ``arrivals`` (request id, prompt tokens, output tokens), schedule,
        execute, update; returns the instance's figures after it."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sched = self.scheduler
        self._round = t
        for req_id, prompt_tokens, output_tokens in arrivals:
            base = sum(map(ord, req_id)) * 7919
            prompt = [(base + j * 31) % 120000 + 100 for j in range(prompt_tokens)]
            params = SamplingParams(ignore_eos=True, max_tokens=output_tokens)
            sched.add_request(
                Request(
                    request_id=req_id,
                    prompt_token_ids=prompt,
                    sampling_params=params,
                    pooling_params=None,
                    block_hasher=self._hasher,
                )
            )
            self.records[req_id] = RequestRecord(arrival=t)
        out = sched.schedule()
        for req_id in out.num_scheduled_tokens:
            rec = self.records[req_id]
            if rec.first_scheduled is None:
                rec.first_scheduled = t
        preempted = out.preempted_req_ids or set()
        for req_id in preempted:
            self.records[req_id].preemptions += 1
        runner_output = self.executor.execute(out)
        tokens = sum(len(s) for s in runner_output.sampled_token_ids)
        for outputs in sched.update_from_output(out, runner_output).values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.records[o.request_id].finished = t
        return StepSample(*self._memory(), preempted=len(preempted), tokens=tokens)

    def _memory(self) -> tuple[int, int]:
        """(bytes held, bytes of blocks in use)."""
        if self.memory is not None:
            pages = self.memory.pages
            if self.spec.step_release:
                pages.trim()  # the end of the step: idle pages go back to the ledger ...
            pages.flush()  # ... before the next instance steps
            used = (self.memory.ledger.used() - 1) * BLOCK_BYTES  # less the null block
            return self._held_in_ledger(), used
        pool = self.scheduler.kv_cache_manager.block_pool
        used = (pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()) * BLOCK_BYTES
        return self.spec.num_blocks * BLOCK_BYTES, used

    def _held_in_ledger(self) -> int:
        """The bytes the shared ledger charges this process now: its record's ``mapped``
        (one record: ``demo-<i>`` with the step-release gate, the adapter's otherwise)."""
        pid = os.getpid()
        return sum(r.mapped for r in self._ledger.snapshot().records if r.pid == pid)

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()  # closes its gate too
        if self._ledger is not None:
            self._ledger.close()


def _instance_main(conn: Connection, spec: InstanceSpec) -> None:
    """Child process: build the instance, then serve ``("step", t, arrivals)`` until
    ``("done",)``, answering each with a ``StepSample`` (or ``("error", text)``)."""
    log = open(spec.log_path, "a")  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 2)  # vLLM's start-up chatter goes to the log, not the table
    os.environ[DIR_ENV] = spec.ledger_dir  # KVCORE_LEDGER_DIR: this run's private ledger
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no accelerator is probed
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model config is a local file
    instance = None
    try:
        instance = _Instance(spec)
        conn.send(("ready",))
        while True:
            msg = conn.recv()
            if msg[0] == "step":
                conn.send(("sample", instance.step(msg[1], msg[2])))
            elif msg[0] == "done":
                conn.send(("records", instance.records))
                break
    except EOFError:  # the parent stopped the run
        pass
    except BaseException as exc:  # reported to the parent, which stops the run
        import traceback

        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send(("error", f"instance {spec.index} ({spec.mode}): {exc!r}"))
    finally:
        if instance is not None:
            instance.close()


# ------------------------------------------------------------------------------ a run


@dataclass
class InstanceResult:
    """Per instance and mode: the timeline and the request records."""

    held: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    preemptions: int = 0
    tokens: int = 0
    records: dict[str, RequestRecord] = field(default_factory=dict)

    def summary(self, steps: int) -> dict[str, float]:
        """The table's figures (module docstring)."""
        recs = list(self.records.values())
        waits = [
            (r.first_scheduled if r.first_scheduled is not None else steps) - r.arrival
            for r in recs
        ]
        return {
            "arrived": len(recs),
            "finished": sum(r.finished is not None for r in recs),
            "tokens": self.tokens,
            "preemptions": self.preemptions,
            "wait_mean": float(np.mean(waits)) if waits else 0.0,
            "wait_p99": float(np.percentile(waits, 99)) if waits else 0.0,
            "peak_held_gib": max(self.held, default=0) / GiB,
        }


class DemoError(RuntimeError):
    """An instance process failed; the message names it, its log has the traceback."""


def run_mode(
    mode: str,
    arrivals: Sequence[Arrival],
    *,
    instances: int,
    steps: int,
    budget_bytes: int,
    workdir: Path,
    logdir: Path,
    on_step: Callable[[], None] = lambda: None,
    step_release: bool = True,
) -> list[InstanceResult]:
    """Run ``arrivals`` through ``instances`` instance processes in ``mode`` for ``steps``
    lock-step rounds, with a fresh ledger under ``workdir`` (a scratch directory) and the
    instances' logs in ``logdir``; returns one result per instance. Raises ``DemoError`` if
    an instance fails (the others are stopped)."""
    from kvcore.budget.ledger import GpuLedger
    from kvcore.vmm import open_backend

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    model_dir = workdir / "model"
    if not (model_dir / "config.json").exists():
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(_MODEL_CONFIG))
    ledger_dir = Path(tempfile.mkdtemp(prefix=f"ledger-{mode}-", dir=workdir))
    probe = open_backend("host")
    device_uuid = probe.device_uuid()
    probe.close()
    ledger = GpuLedger.open(device_uuid, device_total=budget_bytes, directory=ledger_dir)
    ledger.set_budget(budget_bytes)
    total_blocks = budget_bytes // BLOCK_BYTES
    num_blocks = total_blocks if mode == "elastic" else total_blocks // instances
    ctx = multiprocessing.get_context("spawn")
    procs: list[Any] = []
    conns: list[Connection] = []
    try:
        for i in range(instances):
            parent, child = ctx.Pipe()
            spec = InstanceSpec(
                index=i,
                mode=mode,
                num_blocks=num_blocks,
                model_dir=str(model_dir),
                ledger_dir=str(ledger_dir),
                device_uuid=device_uuid,
                log_path=str(logdir / f"{mode}-{i}.log"),
                step_release=step_release,
            )
            proc = ctx.Process(target=_instance_main, args=(child, spec), daemon=True)
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        for conn in conns:
            _expect(conn, "ready")
        results = [InstanceResult() for _ in range(instances)]
        by_step: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for k, a in enumerate(arrivals):
            if a.instance < instances:
                by_step.setdefault((a.step, a.instance), []).append(
                    (f"{a.instance}-{k}", a.prompt_tokens, a.output_tokens)
                )
        for t in range(steps):
            for j in range(instances):
                i = (t + j) % instances  # rotate who steps first
                conns[i].send(("step", t, by_step.get((t, i), [])))
                sample: StepSample = _expect(conns[i], "sample")
                res = results[i]
                res.held.append(sample.held_bytes)
                res.used.append(sample.used_bytes)
                res.preemptions += sample.preempted
                res.tokens += sample.tokens
            on_step()
        for i, conn in enumerate(conns):
            conn.send(("done",))
            results[i].records = _expect(conn, "records")
        return results
    finally:
        for conn in conns:
            conn.close()  # an instance still waiting for a round reads EOF and exits
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        ledger.close()


def _expect(conn: Connection, kind: str) -> Any:
    try:
        msg = conn.recv()
    except EOFError:
        raise DemoError("an instance process died without a word (see its log)") from None
    if msg[0] == "error":
        raise DemoError(msg[1])
    if msg[0] != kind:
        raise DemoError(f"expected {kind!r} from an instance, got {msg[0]!r}")
    return msg[1] if len(msg) > 1 else None


def run_demo(
    arrivals: Sequence[Arrival],
    *,
    instances: int,
    steps: int,
    budget_bytes: int,
    out: Path,
    on_step: Callable[[], None] = lambda: None,
    step_release: bool = True,
) -> dict[str, list[InstanceResult]]:
    """Both modes on the same arrivals; logs under ``out``. Returns results by mode."""
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvcore-colocate-"))
    try:
        return {
            mode: run_mode(
                mode,
                arrivals,
                instances=instances,
                steps=steps,
                budget_bytes=budget_bytes,
                workdir=workdir,
                logdir=out,
                on_step=on_step,
                step_release=step_release,
            )
            for mode in MODES
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ------------------------------------------------------------------------------ output


def summaries(results: dict[str, list[InstanceResult]], steps: int) -> list[dict[str, Any]]:
    """One row per (mode, instance) plus a per-mode total row."""
    rows: list[dict[str, Any]] = []
    for mode, per_instance in results.items():
        for i, res in enumerate(per_instance):
            rows.append({"mode": mode, "instance": str(i), **res.summary(steps)})
        merged = InstanceResult(
            held=[sum(h) for h in zip(*(r.held for r in per_instance), strict=True)],
            preemptions=sum(r.preemptions for r in per_instance),
            tokens=sum(r.tokens for r in per_instance),
            records={k: v for r in per_instance for k, v in r.records.items()},
        )
        rows.append({"mode": mode, "instance": "all", **merged.summary(steps)})
    return rows


def render_table(rows: Sequence[dict[str, Any]], title: str) -> Any:
    """The comparison table (rich)."""
    from rich.table import Table

    table = Table(title=title)
    for name in ("mode", "inst", "finished", "tokens", "preempt"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    table.add_column("wait mean", justify="right")  # queue steps before first scheduled
    table.add_column("wait p99", justify="right")
    table.add_column("peak GiB", justify="right")
    for r in rows:
        style = "bold" if r["instance"] == "all" else None
        table.add_row(
            r["mode"],
            r["instance"],
            f"{r['finished']}/{r['arrived']}",
            f"{r['tokens']}",
            f"{r['preemptions']}",
            f"{r['wait_mean']:.1f}",
            f"{r['wait_p99']:.0f}",
            f"{r['peak_held_gib']:.1f}",
            style=style,
        )
    return table


def plot(results: dict[str, list[InstanceResult]], budget_bytes: int, path: Path) -> None:
    """Memory held per instance over time, one panel per mode (PNG, matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3.4 * len(results)), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (mode, per_instance) in zip(np.atleast_1d(axes), results.items(), strict=True):
        for i, res in enumerate(per_instance):
            x = np.arange(len(res.held))
            color = colors[i % len(colors)]
            lw = 2.8 - 0.8 * i  # static lines coincide: the wider one below stays visible
            ax.plot(x, np.array(res.held) / GiB, color=color, lw=lw, label=f"instance {i} held")
            ax.plot(x, np.array(res.used) / GiB, color=color, lw=0.8, ls=":", alpha=0.9)
        total = np.sum([r.held for r in per_instance], axis=0) / GiB
        ax.plot(np.arange(len(total)), total, color="0.3", lw=0.9, label="sum held")
        ax.axhline(budget_bytes / GiB, color="crimson", ls="--", lw=1, label="GPU KV budget")
        ax.set_ylabel("KV memory (GiB)")
        ax.set_ylim(0, budget_bytes / GiB * 1.08)
        ax.set_title(
            f"{mode}: "
            + (
                "one shared budget through kvcore's per-GPU ledger"
                if mode == "elastic"
                else "budget split evenly, reserved up front (upstream vLLM)"
            ),
            fontsize=10,
        )
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8, ncol=2)
    np.atleast_1d(axes)[-1].set_xlabel("scheduler step (dotted: blocks in use)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--instances", type=int, default=2, choices=(2, 3))
    parser.add_argument("--steps", type=int, default=3000, help="lock-step rounds per mode")
    parser.add_argument("--budget-gib", type=float, default=16.0, help="KV budget of the GPU")
    parser.add_argument("--bursts", type=int, default=3, help="bursts per instance")
    parser.add_argument("--burst-size", type=float, default=128.0, help="mean requests a burst")
    parser.add_argument("--burst-spread", type=int, default=60, help="steps a burst lasts")
    parser.add_argument("--prompt-median", type=float, default=700.0)
    parser.add_argument("--output-mean", type=float, default=220.0)
    parser.add_argument("--trace", type=Path, help="JSON-lines trace instead of a generated one")
    parser.add_argument("--out", type=Path, default=Path("build/colocate"))
    parser.add_argument(
        "--async-release",
        action="store_true",
        help="kvcore's default release (background unmap as soon as a page is free) instead "
        "of the end of each step: timing-dependent, and see _StepReleaseGate",
    )
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = Console()
    spec = WorkloadSpec(
        seed=args.seed,
        instances=args.instances,
        steps=args.steps,
        bursts=args.bursts,
        burst_size=args.burst_size,
        burst_spread=args.burst_spread,
        prompt_median=args.prompt_median,
        output_mean=args.output_mean,
    )
    arrivals = read_trace(args.trace) if args.trace else bursty_workload(spec)
    budget = int(args.budget_gib * GiB) // BLOCK_BYTES * BLOCK_BYTES
    args.out.mkdir(parents=True, exist_ok=True)
    write_trace(arrivals, args.out / "trace.jsonl")
    source = f"trace {args.trace}" if args.trace else f"seed {args.seed}"
    console.print(
        f"[bold]kvcore co-location demo[/]: {args.instances} vLLM engine cores, "
        f"{len(arrivals)} requests ({source}), {args.steps} steps per mode, "
        f"KV budget {budget / GiB:.1f} GiB ({budget // BLOCK_BYTES} blocks of 16 tokens)"
    )
    started = time.monotonic()
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("elastic + static", total=len(MODES) * args.steps)
        try:
            results = run_demo(
                arrivals,
                instances=args.instances,
                steps=args.steps,
                budget_bytes=budget,
                out=args.out,
                on_step=lambda: progress.advance(task),
                step_release=not args.async_release,
            )
        except DemoError as exc:
            console.print(f"[red]demo failed[/]: {exc}; instance logs in {args.out.resolve()}")
            return 1
    rows = summaries(results, args.steps)
    console.print(render_table(rows, f"elastic vs static, {source}, {args.steps} steps"))
    png = args.out / "colocate.png"
    plot(results, budget, png)
    (args.out / "colocate.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
    )
    console.print(f"wall time {time.monotonic() - started:.0f} s; plot: {png.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
