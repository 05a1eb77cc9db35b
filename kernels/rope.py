"""Rotary position embeddings applied to q and k (HF's rotate-half layout: dimension i
pairs with i + D/2): Triton forward and backward beside the PyTorch reference. The
backward is the inverse rotation, so nothing but cos/sin is saved. On CPU, float32
inference takes the native op of csrc/elementwise_cpu.cpp."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lathe.kernels.cpu_native import use_native_cpu
from lathe.kernels.dispatch import opaque_op, use_triton

rope_cpu = opaque_op("rope_cpu", "(Tensor x, Tensor cos, Tensor sin) -> Tensor", None,
                     lambda x, cos, sin: x.new_empty(x.shape))


def rotate_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """(B, H, T, D) x rotated by (B, T, D) cos/sin, returned in x's dtype as the kernel's is
    (bf16 q and k against fp32 tables would otherwise come back fp32, beside a bf16 v)."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def rope_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return rotate_reference(q, cos, sin), rotate_reference(k, cos, sin)


@triton.jit
def _rope_kernel(X, COS, SIN, Y, n_rows, heads, seq, half, SIGN: tl.constexpr,
                 BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Rotate rows of (B·H·T, D) X; SIGN = -1 rotates backwards (the gradient)."""
    cols = tl.arange(0, BLOCK)
    ok = cols < half
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < n_rows:
            b = row // (heads * seq)
            t = row % seq
            base = row * 2 * half
            trig = (b * seq + t) * 2 * half
            x1 = tl.load(X + base + cols, mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(X + base + half + cols, mask=ok, other=0.0).to(tl.float32)
            c = tl.load(COS + trig + cols, mask=ok, other=0.0).to(tl.float32)
            s = tl.load(SIN + trig + cols, mask=ok, other=0.0).to(tl.float32) * SIGN
            tl.store(Y + base + cols, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=ok)
            tl.store(Y + base + half + cols, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=ok)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: int) -> Tensor:
    x = x.contiguous()
    batch, heads, seq, dim = x.shape
    y = torch.empty_like(x)
    rows, per_program = batch * heads * seq, 8
    _rope_kernel[(triton.cdiv(rows, per_program),)](
        x, cos, sin, y, rows, heads, seq, dim // 2, SIGN=sign,
        BLOCK=triton.next_power_of_2(dim // 2), ROWS=per_program)
    return y


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(q, cos, sin, 1), _rotate(k, cos, sin, 1)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor) -> tuple[Tensor, Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(dq, cos, sin, -1), _rotate(dk, cos, sin, -1), None, None


def rope_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _RoPE.apply(q, k, cos.expand(q.shape[0], -1, -1), sin.expand(q.shape[0], -1, -1))


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate (B, H, T, D) q and (B, H_kv, T, D) k by (B, T, D) cos/sin (Triton on CUDA,
    native float32 inference on CPU, the reference elsewhere)."""
    if use_triton("rope", q):
        return rope_triton(q, k, cos, sin)
    if use_native_cpu("rope", q, k, cos, sin):
        return rope_cpu(q, cos, sin), rope_cpu(k, cos, sin)
    return rope_reference(q, k, cos, sin)
