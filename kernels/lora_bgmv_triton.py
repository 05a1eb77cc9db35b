"""The Triton kernels of `lora_bgmv` (Punica's BGMV, as vLLM's shrink and expand): each row
reads only its own slot's A and B, where the reference's traced gathers copy every row's
A and B out first (`lathe.kernels.lora_bgmv` holds the reference and the dispatch, and
imports this module only on the Triton path).

Shrink: h[n] = x[n] · A[slot] over `in`, split into `split_k` parts a row so that a decode
step of a few rows still fills the GPU; each part writes its own fp32 partial (no atomics:
the sum is the same every run). Expand: out[n] = y[n] + scale[slot] · (Σ parts h[n]) · B[slot]
over a tile of `out` a program; a row of slot -1 (the base model's, or padding) is copied.
Every load of a slot's weights is masked by the row's slot being one of the slots, so no
row reads another's, and an adapter's NaN stays in its own rows; a slot past the slots,
which the host cannot see without waiting on the device, is read as none rather than out
of bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _shrink(X, A, ROW_SLOTS, H, n_slots, d_in, rank, chunk, split_k,
            BLOCK_K: tl.constexpr, RANK: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    slot = tl.load(ROW_SLOTS + row)
    reads = tl.where((slot >= 0) & (slot < n_slots), d_in, 0)  # a base row reads nothing
    ranks = tl.arange(0, RANK)
    rank_ok = ranks < rank
    acc = tl.zeros([RANK], dtype=tl.float32)
    for start in range(0, chunk, BLOCK_K):
        k = part * chunk + start + tl.arange(0, BLOCK_K)
        k_ok = k < reads
        x = tl.load(X + row * d_in + k, mask=k_ok, other=0.0)
        a = tl.load(A + (tl.maximum(slot, 0) * d_in + k[:, None]) * rank + ranks[None, :],
                    mask=k_ok[:, None] & rank_ok[None, :], other=0.0)
        # x in the adapters' dtype, as the reference multiplies it
        acc += tl.sum(x.to(A.dtype.element_ty).to(tl.float32)[:, None] * a.to(tl.float32),
                      axis=0)
    tl.store(H + (row * split_k + part) * RANK + ranks, acc)


@triton.jit
def _expand(Y, H, B, SCALE, ROW_SLOTS, OUT, n_slots, d_out, rank, split_k,
            BLOCK_N: tl.constexpr, RANK: tl.constexpr, SPLIT_PAD: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < d_out
    y = tl.load(Y + row * d_out + cols, mask=col_ok, other=0.0)
    slot = tl.load(ROW_SLOTS + row)
    mine = (slot >= 0) & (slot < n_slots)
    reads = tl.where(mine, rank, 0)  # a base row reads nothing
    ranks, parts = tl.arange(0, RANK), tl.arange(0, SPLIT_PAD)
    h = tl.sum(tl.load(H + (row * split_k + parts[:, None]) * RANK + ranks[None, :],
                       mask=(parts < split_k)[:, None], other=0.0), axis=0)
    b = tl.load(B + (tl.maximum(slot, 0) * rank + ranks[:, None]) * d_out + cols[None, :],
                mask=(ranks < reads)[:, None] & col_ok[None, :], other=0.0)
    scale = tl.load(SCALE + tl.minimum(tl.maximum(slot, 0), n_slots - 1))
    delta = tl.sum(h[:, None] * b.to(tl.float32), axis=0) * scale
    out = tl.where(mine, y + delta.to(y.dtype), y)
    tl.store(OUT + row * d_out + cols, out.to(OUT.dtype.element_ty), mask=col_ok)


# Launch shape, not yet tuned on a GPU: a (BLOCK_K × rank) tile of A of about 2,048
# elements, each row's `in` split so that a step has at least TARGET_PROGRAMS shrink programs
# (a decode step of 1-8 rows would otherwise run a handful), and 128 outputs an expand program.
A_TILE, TARGET_PROGRAMS, BLOCK_N = 2048, 128, 128


def _check(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor,
           row_slots: Tensor) -> None:
    """The shapes the kernels index by, checked before they read: what the native op checks,
    but the slot values, which the host cannot read without waiting on the device."""
    if x.dim() != 2 or y.dim() != 2 or lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError("lora_bgmv: x and y must be 2-d, lora_a and lora_b 3-d; got "
                         f"{x.dim()}, {y.dim()}, {lora_a.dim()}, {lora_b.dim()}")
    slots, d_in, rank = lora_a.shape
    if (y.shape[0] != x.shape[0] or x.shape[1] != d_in or lora_b.shape[:2] != (slots, rank)
            or y.shape[1] != lora_b.shape[2] or scale.shape != (slots,)):
        raise ValueError(f"lora_bgmv: shapes do not chain: y {tuple(y.shape)}, x "
                         f"{tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, lora_b "
                         f"{tuple(lora_b.shape)}, scale {tuple(scale.shape)}")
    if row_slots.dim() != 1 or row_slots.shape[0] < x.shape[0]:
        raise ValueError(f"lora_bgmv: row_slots needs at least {x.shape[0]} entries, one a "
                         f"row; got shape {tuple(row_slots.shape)}")
    if lora_a.dtype != lora_b.dtype:
        raise ValueError(f"lora_bgmv: lora_a is {lora_a.dtype} and lora_b {lora_b.dtype}; "
                         "store the slots in one dtype")


def lora_bgmv_triton(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor,
                     row_slots: Tensor) -> Tensor:
    """`lora_bgmv_reference`'s answer: (rows, out) `y` plus each (rows, in) `x` row's own
    adapter delta, in y's dtype (h kept in fp32 between the two kernels)."""
    _check(y, x, lora_a, lora_b, scale, row_slots)
    rows, d_in = x.shape
    if rows == 0:
        return torch.empty_like(y)
    n_slots, _, rank = lora_a.shape
    d_out = lora_b.shape[-1]
    x, y = x.contiguous(), y.contiguous()
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    rank_pad = max(16, triton.next_power_of_2(rank))
    block_k = max(16, min(256, A_TILE // rank_pad))
    blocks = triton.cdiv(d_in, block_k)
    split_k = max(1, min(blocks, TARGET_PROGRAMS // rows))
    chunk = triton.cdiv(blocks, split_k) * block_k
    split_k = triton.cdiv(d_in, chunk)  # no part left empty
    h = torch.empty(rows, split_k, rank_pad, device=x.device, dtype=torch.float32)
    out = torch.empty_like(y)
    _shrink[(rows, split_k)](x, lora_a, row_slots, h, n_slots, d_in, rank, chunk, split_k,
                             BLOCK_K=block_k, RANK=rank_pad)
    _expand[(rows, triton.cdiv(d_out, BLOCK_N))](
        y, h, lora_b, scale, row_slots, out, n_slots, d_out, rank, split_k, BLOCK_N=BLOCK_N,
        RANK=rank_pad, SPLIT_PAD=triton.next_power_of_2(split_k))
    return out
