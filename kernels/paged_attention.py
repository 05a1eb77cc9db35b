"""Decode attention over a paged KV cache: one new query token per sequence attends over
its context, read block by block through its block table (the serve engine's layout:
slabs of (num_blocks · block_size, n_kv_heads, head_dim) rows, block b's slot i at row
b · block_size + i). One Triton program per (sequence, KV head) serves all the query
heads of that KV group with an online softmax, so GQA reads each key once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from lathe.kernels.dispatch import use_triton


def paged_decode_reference(q: Tensor, k_slab: Tensor, v_slab: Tensor, block_tables: Tensor,
                           context_lens: Tensor, block_size: int) -> Tensor:
    """(B, H, D) queries; block_tables (B, max_blocks) int; context_lens (B,) -> (B, H, D)."""
    out = torch.empty_like(q)
    offsets = torch.arange(block_size, device=q.device)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        slots = (block_tables[b, :(n + block_size - 1) // block_size, None] * block_size
                 + offsets).flatten()[:n]
        keys, values = k_slab[slots].transpose(0, 1), v_slab[slots].transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(
            q[b, :, None], keys, values, enable_gqa=q.shape[1] != k_slab.shape[1])[:, 0]
    return out


@triton.jit
def _paged_decode(Q, K, V, TABLES, LENS, OUT, scale, max_blocks, n_heads, n_kv_heads,
                  BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  GROUP_PAD: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (seq * n_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
                mask=head_ok[:, None], other=0.0).to(tl.float32)
    length = tl.load(LENS + seq)
    running_max = tl.full([GROUP_PAD], -float("inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    for j in range(0, tl.cdiv(length, BLOCK_SIZE)):
        block = tl.load(TABLES + seq * max_blocks + j).to(tl.int64)
        rows = block * BLOCK_SIZE + offsets
        ok = j * BLOCK_SIZE + offsets < length
        kv = (rows[:, None] * n_kv_heads + kv_head) * HEAD_DIM + dims[None, :]
        k = tl.load(K + kv, mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(V + kv, mask=ok[:, None], other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(ok[None, :], scores, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        total = total * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p, v)
        running_max = new_max
    out = acc / total[:, None]
    tl.store(OUT + (seq * n_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
             out.to(OUT.dtype.element_ty), mask=head_ok[:, None])


def paged_decode_triton(q: Tensor, k_slab: Tensor, v_slab: Tensor, block_tables: Tensor,
                        context_lens: Tensor, block_size: int) -> Tensor:
    q = q.contiguous()  # before empty_like, which would copy a strided layout
    batch, n_heads, head_dim = q.shape
    n_kv_heads = k_slab.shape[1]
    group = n_heads // n_kv_heads
    out = torch.empty_like(q)
    tables = block_tables.to(torch.int32).contiguous()
    _paged_decode[(batch, n_kv_heads)](
        q, k_slab, v_slab, tables, context_lens.to(torch.int32).contiguous(), out,
        head_dim ** -0.5, tables.shape[1], n_heads, n_kv_heads, BLOCK_SIZE=block_size,
        GROUP=group, HEAD_DIM=head_dim, GROUP_PAD=max(16, triton.next_power_of_2(group)))
    return out


def paged_decode(q: Tensor, k_slab: Tensor, v_slab: Tensor, block_tables: Tensor,
                 context_lens: Tensor, block_size: int) -> Tensor:
    """Decode attention through block tables (Triton on CUDA, gather + SDPA elsewhere)."""
    if use_triton("paged_decode", q):
        return paged_decode_triton(q, k_slab, v_slab, block_tables, context_lens, block_size)
    return paged_decode_reference(q, k_slab, v_slab, block_tables, context_lens, block_size)
