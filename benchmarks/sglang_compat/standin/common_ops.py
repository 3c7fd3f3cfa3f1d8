"""A stand-in for sgl_kernel's compiled ``common_ops``, for a torch whose ABI it was not built
for (the lent H200's torch 2.11): the two ops SGLang 0.5.23's dense path calls, in torch.

Why: sglang-kernel 0.4.10 is built against torch 2.13+ headers. Their ``TensorImpl`` fields
sit 8 bytes lower and their ``DispatchKey`` numbers one lower than torch 2.11's, so its binary
reads the wrong fields of every tensor even where it links (``README.md`` here). What SGLang
0.5.23 calls of it for a dense Llama/Qwen3 model with ``--attention-backend triton
--sampling-backend pytorch`` and no flashinfer is ``rmsnorm`` and ``fused_add_rmsnorm``
(RoPE, the fused QK norm and the activation are SGLang's own JIT kernels).

How it is found: sgl_kernel's loader (``load_utils._load_architecture_specific_ops``) tries
``sm90/common_ops.*`` and ``common_ops.*`` inside its package, then a plain ``import
common_ops``. Carry the wheel's Python files and dist-info without any ``common_ops`` binary
(``pack_sgl_kernel.sh --no-binary``) and put this folder on ``PYTHONPATH``: ``import
sgl_kernel`` then imports this module, which defines the ``sgl_kernel`` operator namespace
with the two ops under sgl_kernel's own schemas. Any other ``torch.ops.sgl_kernel.*`` call
fails loudly (no such operator), so nothing runs on a guess.

What the figures then describe: SGLang with these two norms as unfused torch ops (an fp32
reduction and a few elementwise kernels per call, where sgl_kernel runs one). Both modes of a
comparison (elastic KV on and off) run the same ops, so their ratios are SGLang's; absolute
throughput is lower than with sgl_kernel. ``check_ops.py`` compares the ops against its
torch references on the device.

``enable_pdl`` (programmatic dependent launch, a launch attribute of sgl_kernel's kernels) has
no meaning for torch ops and is ignored.
"""

from __future__ import annotations

import torch

# the library object must live as long as the ops: the module keeps it
_LIB = torch.library.Library("sgl_kernel", "DEF")
_LIB.define(
    "rmsnorm(Tensor! output, Tensor input, Tensor weight, float eps, bool enable_pdl) -> ()"
)
_LIB.define(
    "fused_add_rmsnorm(Tensor! input, Tensor! residual, Tensor weight, float eps, "
    "bool enable_pdl) -> ()"
)


def _normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / RMS(x) * weight`` over the last dimension, in fp32, cast back to ``x``'s dtype
    (sgl_kernel's norms accumulate in fp32 and round once at the end)."""
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv * weight.float()).to(x.dtype)


def _rmsnorm(
    output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float, enable_pdl: bool
) -> None:
    output.copy_(_normed(input, weight, eps))


def _fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    enable_pdl: bool,
) -> None:
    # as the kernel: the sum in fp32 is stored to ``residual`` (rounded to its dtype) and
    # normalised unrounded into ``input``
    total = input.float() + residual.float()
    residual.copy_(total)
    inv = torch.rsqrt(total.pow(2).mean(dim=-1, keepdim=True) + eps)
    input.copy_(total * inv * weight.float())


_LIB.impl("rmsnorm", _rmsnorm, "CompositeExplicitAutograd")
_LIB.impl("fused_add_rmsnorm", _fused_add_rmsnorm, "CompositeExplicitAutograd")
