"""The KV cache layouts elastic KV runs on, narrowed before vLLM resolves one.

vLLM names a KV cache layout by the physical order of the logical axes ``[L, B, H, N, C]``
(layer, block, head, token slot, content: ``vllm/v1/kv_cache_layout.py``) and resolves one
layout per engine in the engine core, from the lists of layouts each worker's attention
backends support, most preferred first. FLASH_ATTN and TRITON_ATTN declare no preference, so
vLLM takes ``LBNHC``: layer-outermost, each layer's blocks in a region of their own.

kvcore backs a block-compact layout, where the layer and block axes come first (a block of
a layer is one contiguous cell): layer-outermost (``LBNHC``, ``LBHNC``: a range per layer,
``per-layer``; ``groups.engine_layout``) on one GPU, and block-outermost (``BLNHC``,
``BLHNC``: one row of every layer per block id, ``compound``) everywhere. kvcore's TP x PP
channel serves compound rows only. ``elastic_kv_cache_layouts`` is called by the engine core
(patch ``v1/engine: elastic KV resolves a KV cache layout kvcore can back``) on the workers'
lists before ``resolve_kv_cache_layout`` and keeps the layouts kvcore can back there. On one
GPU that is each backend's own list in its own order, then the block-outermost forms
(``B`` moved to the front: ``LBNHC`` -> ``BLNHC``; a layer's block keeps its ``[N, H, C]``
order), so vLLM resolves the layout it would without elastic KV (``LBNHC`` for FLASH_ATTN
and TRITON_ATTN) and the kernels see upstream's tensors. Under TP x PP only the
block-outermost forms remain (``BLNHC``). ``VLLM_KV_CACHE_LAYOUT`` may ask for any layout
kvcore can back; ``docs/vllm.md`` ("KV cache layout") says what each costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcore.errors import UnsupportedConfiguration

__all__ = ["backable_layouts", "block_outermost_form", "elastic_kv_cache_layouts"]

_LEGACY = {"NHD": "LBNHC", "HND": "LBHNC"}
"""vLLM's legacy layout names and the layouts they alias (``resolve_kv_cache_layout``)."""


def block_outermost_form(name: str) -> str:
    """``name`` (a vLLM layout name, legacy aliases accepted) with the block axis moved to the
    front: the layout whose per-layer block has the same axis order, blocks outermost."""
    name = _LEGACY.get(name, name)
    return "B" + name.replace("B", "", 1)


def backable_layouts(*, channel: bool) -> tuple[str, ...]:
    """The vLLM layouts kvcore can back: the block-compact ones, block-outermost only when
    the TP x PP channel serves the memory (``channel``)."""
    return ("BLNHC", "BLHNC") if channel else ("LBNHC", "LBHNC", "BLNHC", "BLHNC")


def elastic_kv_cache_layouts(
    vllm_config: Any, supported: Sequence[Sequence[str]]
) -> list[list[str]]:
    """The layouts of ``supported`` (one list of layout names per worker, as
    ``Executor.get_supported_kv_cache_layouts`` returns them) that kvcore can back in this
    engine (``backable_layouts``): on one GPU each worker's own layouts in its backends'
    order, then their block-outermost forms; under TP x PP the block-outermost forms only.
    For the engine core to pass to ``resolve_kv_cache_layout`` instead of ``supported`` when
    elastic KV is on.

    Raises ``UnsupportedConfiguration`` when ``VLLM_KV_CACHE_LAYOUT`` (or a layout already
    recorded on ``cache_config.kv_cache_layout``) names a layout kvcore cannot back here,
    and when a worker's backends support none it can."""
    from vllm import envs

    parallel = vllm_config.parallel_config
    ranks = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
    channel = ranks > 1
    backable = backable_layouts(channel=channel)
    where = f"TP x PP = {ranks}" if channel else "one GPU"
    recorded = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    for setting, requested in (
        ("VLLM_KV_CACHE_LAYOUT", envs.VLLM_KV_CACHE_LAYOUT),
        ("cache_config.kv_cache_layout", recorded),
    ):
        if requested is not None and _LEGACY.get(requested, requested) not in backable:
            raise UnsupportedConfiguration(
                f"--kvcore-elastic: {setting}={requested} is a KV cache layout kvcore cannot "
                f"back with {where} (it backs {', '.join(backable)}: a block of a layer must "
                "be one contiguous cell, and kvcore's TP x PP channel needs blocks outermost)",
                hint=f"unset VLLM_KV_CACHE_LAYOUT or set it to one of {', '.join(backable)}",
            )
    narrowed: list[list[str]] = []
    for names in supported:
        offered = list(names)
        outer = [block_outermost_form(n) for n in offered]
        forms = outer + offered if channel else offered + outer
        keep = list(dict.fromkeys(f for f in forms if f in offered and f in backable))
        if not keep:
            raise UnsupportedConfiguration(
                "--kvcore-elastic: the attention backends support no KV cache layout kvcore "
                f"can back with {where} (they support {', '.join(offered)}; kvcore backs "
                f"{', '.join(backable)})",
                hint="choose another --attention-backend, or serve without --kvcore-elastic",
            )
        narrowed.append(keep)
    return narrowed
