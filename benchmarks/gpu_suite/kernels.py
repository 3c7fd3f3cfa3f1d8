"""The Triton kernel of the paged-KV read-bandwidth figure (``gpu_suite``, figure b).

``paged_kv_read(k, v, block_table, out)`` reads, for every sequence of a decode batch and
every block in that sequence's row of the block table, the block's K and V for one layer
(the access pattern of paged-attention decode: one program per (sequence, KV head, split of
the row), blocks visited in block-table order, each block a ``[block_size, head_dim]`` tile
per head, as split-KV decode kernels do) and writes one float32 sum per (sequence, head,
split) to ``out`` so the compiler cannot drop a read.

``k`` and ``v`` are ``(num_blocks, block_size, num_kv_heads, head_dim)`` views with any
block stride (contiguous per-layer tensors, or the compound layout's views whose block
stride spans every layer); the token, head and dim strides must be the dense ones.

``reference_read`` computes the same sums with plain torch ops (the correctness reference,
and the reader ``gpu_suite --dry-run`` uses where Triton cannot run).

``HAVE_TRITON`` says whether the kernel is available. Set ``TRITON_INTERPRET=1`` before the
import to run the kernel on CPU tensors (slow; tiny shapes only).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the dry run and CPU tests use ``reference_read`` only
    triton = None

HAVE_TRITON = triton is not None


def _paged_kv_read_kernel(
    k_ptr,
    v_ptr,
    table_ptr,
    out_ptr,
    blocks_per_seq,
    blocks_per_split,
    num_heads,
    num_splits,
    stride_block,
    stride_token,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    tok = tl.arange(0, BLOCK_SIZE)
    dim = tl.arange(0, HEAD_DIM)
    tile = tok[:, None] * stride_token + head * stride_head + dim[None, :]
    acc = tl.zeros([BLOCK_SIZE, HEAD_DIM], dtype=tl.float32)
    row = table_ptr + seq * blocks_per_seq
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, blocks_per_seq)
    for i in range(first, last):
        block = tl.load(row + i).to(tl.int64)
        base = block * stride_block
        k = tl.load(k_ptr + base + tile)
        v = tl.load(v_ptr + base + tile)
        acc += k.to(tl.float32) + v.to(tl.float32)
    total = tl.sum(tl.sum(acc, axis=1), axis=0)
    tl.store(out_ptr + (seq * num_heads + head) * num_splits + split, total)


if HAVE_TRITON:
    _paged_kv_read_kernel = triton.jit(_paged_kv_read_kernel)


def _check_view(name: str, t: torch.Tensor) -> None:
    if t.dim() != 4:
        raise ValueError(f"{name}: expected (blocks, block_size, heads, head_dim), got {t.shape}")
    _, _, heads, head_dim = t.shape
    if t.stride(3) != 1 or t.stride(2) != head_dim or t.stride(1) != heads * head_dim:
        raise ValueError(f"{name}: token/head/dim strides must be dense, got {t.stride()}")


def paged_kv_read(
    k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor
) -> None:
    """Launch the gather-and-sum over ``block_table`` (int32, ``(seqs, blocks_per_seq)``)
    into ``out`` (float32, ``(seqs, heads, splits)``: each row of the table is read by
    ``splits`` programs per head). Asynchronous on the current stream."""
    _check_view("k", k)
    _check_view("v", v)
    if k.shape != v.shape or k.stride() != v.stride():
        raise ValueError(f"k and v differ: {k.shape}/{k.stride()} vs {v.shape}/{v.stride()}")
    if not HAVE_TRITON:
        raise RuntimeError("paged_kv_read needs Triton; use reference_read without it")
    seqs, blocks_per_seq = block_table.shape
    _, block_size, heads, head_dim = k.shape
    splits = out.shape[-1]
    if out.shape != (seqs, heads, splits) or out.dtype != torch.float32 or splits < 1:
        raise ValueError(
            f"out must be float32 ({seqs}, {heads}, splits), got {out.dtype} {out.shape}"
        )
    _paged_kv_read_kernel[(seqs, heads, splits)](
        k,
        v,
        block_table,
        out,
        blocks_per_seq,
        -(-blocks_per_seq // splits),
        heads,
        splits,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
    )


def reference_read(k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The sums ``paged_kv_read`` computes, added over the splits, with torch ops (float32,
    ``(seqs, heads)``)."""
    idx = block_table.long()
    kb = k[idx].float()  # (seqs, blocks_per_seq, block_size, heads, head_dim)
    vb = v[idx].float()
    return (kb + vb).sum(dim=(1, 2, 4))
