"""A stand-in for SGLang 0.5.23's ``sglang/kernels/ops/gemm/cutedsl_dual_gemm.py`` on a GPU
older than Blackwell (the lent H200), where that module's kernel can never run.

Why: every dense Llama/Qwen MLP builds a ``DualGemm`` (``sglang/srt/layers/dual_gemm.py``),
whose mode selection imports this module on CUDA. Upstream's module is a Blackwell (SM100)
CuTe DSL kernel and imports CUTLASS's Python DSL at its top (``nvidia-cutlass-dsl``: 95 MB of
wheels, not in the GPU machine's image). ``DualGemm`` reads three names from it and keeps
the kernel only when ``can_use_dual_gemm`` says yes, which upstream's predicate never does
without SM100 support (``is_sm100_supported()``): on Hopper the mode is ``None`` and the MLP
runs its plain gate/up and down GEMMs. This module gives the same three names and the same
answer there, and refuses a Blackwell GPU (where upstream would run the kernel) instead of
answering for it.

How it is used: ``benchmarks/sglang_bundle.py`` packs this file in place of upstream's
(``STANDINS``); the manifest lists the replacement. The figures then describe SGLang as it
runs on Hopper: the replaced kernel is one upstream does not run there.
"""

from __future__ import annotations

from enum import IntEnum

MAX_DUAL_GEMM_DECODE_TOKENS = 16
"""Upstream's bound on the decode tokens of one dual-GEMM launch (read by ``DualGemm``)."""


class DualGemmQuantMode(IntEnum):
    """Upstream's quantization modes, same names and values."""

    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4


def can_use_dual_gemm(
    num_tokens: int, hidden_size: int, intermediate_size: int, quant_mode: DualGemmQuantMode
) -> bool:
    """``False`` where upstream's predicate is ``False`` for every shape: no SM100 support.

    Raises ``RuntimeError`` on a GPU with SM100 support, where upstream could say yes and run
    a kernel this stand-in does not have."""
    from sglang.srt.utils import is_sm100_supported

    if is_sm100_supported():
        raise RuntimeError(
            "the cutedsl_dual_gemm stand-in of benchmarks/sglang_compat is for GPUs before "
            "Blackwell; on this GPU carry nvidia-cutlass-dsl and SGLang's own module"
        )
    return False
