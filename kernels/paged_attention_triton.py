"""The Triton paged decode attention with split-KV partitions and their merge
(`lathe.kernels.paged_attention` holds the reference, the CPU op and the dispatch, and
imports this module only on the Triton path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lathe.kernels.dispatch import (
    dot_precision,
)


@triton.jit
def _paged_decode(Q, K, V, TABLES, LENS, OUT, PART_OUT, PART_LSE, SCALE: tl.constexpr,
                  max_blocks, n_heads,
                  n_kv_heads, partition_blocks, num_partitions, BLOCK_SIZE: tl.constexpr,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  GROUP_PAD: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(Q + (seq * n_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    length = tl.load(LENS + seq)
    running_max = tl.full([GROUP_PAD], -float("inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)
    first = part * partition_blocks
    last = tl.minimum(tl.cdiv(length, BLOCK_SIZE), first + partition_blocks)
    for j in range(first, last):
        block = tl.load(TABLES + seq * max_blocks + j).to(tl.int64)
        rows = block * BLOCK_SIZE + offsets
        ok = j * BLOCK_SIZE + offsets < length
        kv = (rows[:, None] * n_kv_heads + kv_head) * HEAD_DIM + dims[None, :]
        k = tl.load(K + kv, mask=ok[:, None] & dim_ok[None, :], other=0.0)
        v = tl.load(V + kv, mask=ok[:, None] & dim_ok[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SCALE
        scores = tl.where(ok[None, :], scores, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        total = total * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    store_mask = head_ok[:, None] & dim_ok[None, :]
    if SPLIT:  # this partition's normalized output and log-sum-exp; empty ones weigh 0
        seen = total > 0
        safe_total = tl.where(seen, total, 1.0)  # acc is 0 where nothing was seen
        row = (seq * n_heads + heads) * num_partitions + part
        tl.store(PART_OUT + row[:, None] * HEAD_DIM + dims[None, :], acc / safe_total[:, None],
                 mask=store_mask)
        tl.store(PART_LSE + row, tl.where(seen, running_max + tl.log(safe_total), -float("inf")),
                 mask=head_ok)
    else:
        tl.store(OUT + (seq * n_heads + heads[:, None]) * HEAD_DIM + dims[None, :],
                 (acc / total[:, None]).to(OUT.dtype.element_ty), mask=store_mask)


@triton.jit
def _merge_partitions(PART_OUT, PART_LSE, OUT, num_partitions, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, PART_PAD: tl.constexpr):
    row = tl.program_id(0)  # one (sequence, query head)
    parts = tl.arange(0, PART_PAD)
    part_ok = parts < num_partitions
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(PART_LSE + row * num_partitions + parts, mask=part_ok, other=-float("inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))
    outs = tl.load(PART_OUT + (row * num_partitions + parts[:, None]) * HEAD_DIM + dims[None, :],
                   mask=part_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(weights[:, None] * outs, axis=0) / tl.sum(weights, axis=0)
    tl.store(OUT + row * HEAD_DIM + dims, out.to(OUT.dtype.element_ty), mask=dims < HEAD_DIM)


def num_partitions(batch: int, n_heads: int, max_context: int, partition_size: int) -> int:
    """How many KV partitions a decode step splits each sequence into (vLLM's rule): one
    when the longest context fits a partition, or when batch × heads already fills the GPU
    and no context passes 8192 tokens; otherwise enough to cover the longest context."""
    parts = triton.cdiv(max_context, partition_size)
    if parts == 1 or (batch * n_heads > 512 and max_context <= 8192):
        return 1
    return parts


def paged_decode_triton(q: Tensor, k_slab: Tensor, v_slab: Tensor, block_tables: Tensor,
                        context_lens: Tensor, block_size: int,
                        partition_size: int = 512) -> Tensor:
    """`partition_size` tokens (a multiple of `block_size`) per split-KV program."""
    if partition_size % block_size:
        raise ValueError(f"partition_size={partition_size} must be a multiple of "
                         f"block_size={block_size}")
    q = q.contiguous()  # before empty_like, which would copy a strided layout
    batch, n_heads, head_dim = q.shape
    n_kv_heads = k_slab.shape[1]
    group = n_heads // n_kv_heads
    out = torch.empty_like(q)
    tables = block_tables.to(torch.int32).contiguous()
    partition_blocks = partition_size // block_size
    parts = num_partitions(batch, n_heads, tables.shape[1] * block_size, partition_size)
    split = parts > 1
    part_out = torch.empty(batch * n_heads * parts if split else 0, head_dim,
                           dtype=torch.float32, device=q.device)
    part_lse = torch.empty(part_out.shape[0], dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _paged_decode[(batch, n_kv_heads, parts)](
        q, k_slab, v_slab, tables, context_lens.to(torch.int32).contiguous(), out, part_out,
        part_lse, head_dim ** -0.5, tables.shape[1], n_heads, n_kv_heads, partition_blocks,
        parts, BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), SPLIT=split,
        PRECISION=dot_precision(q.dtype))
    if split:
        _merge_partitions[(batch * n_heads,)](
            part_out, part_lse, out, parts, HEAD_DIM=head_dim, BLOCK_D=block_d,
            PART_PAD=triton.next_power_of_2(parts))
    return out
