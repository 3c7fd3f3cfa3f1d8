"""The KV cache layouts elastic KV runs on, narrowed before vLLM resolves one.

vLLM names a KV cache layout by the physical order of the logical axes ``[L, B, H, N, C]``
(layer, block, head, token slot, content: ``vllm/v1/kv_cache_layout.py``) and resolves one
layout per engine in the engine core, from the lists of layouts each worker's attention
backends support, most preferred first. FLASH_ATTN and TRITON_ATTN declare no preference, so
vLLM takes ``LBNHC``: layer-outermost, each layer's blocks in a region of its own.

kvcore backs a block id as one row of every layer (``groups.engine_row_bytes``), so elastic KV
needs ``B`` outermost. ``elastic_kv_cache_layouts`` is called by the engine core (patch
``v1/engine: elastic KV resolves a block-outermost KV cache layout``) on those lists, before
``resolve_kv_cache_layout``: it replaces each layout by its block-outermost form (``B``
moved to the front: ``LBNHC`` -> ``BLNHC``, ``LBHNC`` -> ``BLHNC``) where the backends support
that form, in the backends' order. vLLM then resolves the block-outermost form of what it would
have chosen: a layer's block keeps the ``[N, H, C]`` order the kernels prefer, and only the
distance between one block and the next grows (by the number of layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcore.errors import UnsupportedConfiguration

__all__ = ["block_outermost_form", "elastic_kv_cache_layouts"]

_LEGACY = {"NHD": "LBNHC", "HND": "LBHNC"}
"""vLLM's legacy layout names and the layouts they alias (``resolve_kv_cache_layout``)."""


def block_outermost_form(name: str) -> str:
    """``name`` (a vLLM layout name, legacy aliases accepted) with the block axis moved to the
    front: the layout whose per-layer block has the same axis order, blocks outermost."""
    name = _LEGACY.get(name, name)
    return "B" + name.replace("B", "", 1)


def elastic_kv_cache_layouts(
    vllm_config: Any, supported: Sequence[Sequence[str]]
) -> list[list[str]]:
    """The block-outermost layouts of ``supported`` (one list of layout names per worker, as
    ``Executor.get_supported_kv_cache_layouts`` returns them), each worker's list in its
    backends' order of preference, block-outermost forms first; for the engine core to pass
    to ``resolve_kv_cache_layout`` instead of ``supported`` when elastic KV is on.

    Raises ``UnsupportedConfiguration`` when ``VLLM_KV_CACHE_LAYOUT`` (or a layout already
    recorded on ``cache_config.kv_cache_layout``) names a layer-outermost layout, and when a
    worker's backends support no block-outermost layout."""
    from vllm import envs

    cache_config = vllm_config.cache_config
    for setting, requested in (
        ("VLLM_KV_CACHE_LAYOUT", envs.VLLM_KV_CACHE_LAYOUT),
        ("cache_config.kv_cache_layout", getattr(cache_config, "kv_cache_layout", None)),
    ):
        if requested is not None and not _LEGACY.get(requested, requested).startswith("B"):
            form = block_outermost_form(requested)
            raise UnsupportedConfiguration(
                f"--kvcore-elastic: {setting}={requested} is a layer-outermost KV cache "
                "layout (each layer's blocks in a region of its own); elastic KV backs a "
                "block id as one row of every layer and needs the block axis outermost",
                hint=f"unset VLLM_KV_CACHE_LAYOUT (elastic KV then runs {form}, the same "
                f"layout with blocks outermost) or set VLLM_KV_CACHE_LAYOUT={form}",
            )
    narrowed: list[list[str]] = []
    for names in supported:
        offered = list(names)
        forms = [block_outermost_form(n) for n in offered]
        keep = list(dict.fromkeys(f for f in forms if f in offered))
        if not keep:
            raise UnsupportedConfiguration(
                "--kvcore-elastic: the attention backends support only layer-outermost KV "
                f"cache layouts ({', '.join(offered)}); elastic KV needs the block axis "
                "outermost",
                hint="choose another --attention-backend, or serve without --kvcore-elastic",
            )
        narrowed.append(keep)
    return narrowed
