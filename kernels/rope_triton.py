"""The Triton rotation of RoPE, forward and backward (`lathe.kernels.rope` holds the
reference and imports this module only on the Triton path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


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
