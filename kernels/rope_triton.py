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
    """Rotate a tile of ROWS rows of (B·H·T, D) X at once; SIGN = -1 rotates backwards (the
    gradient)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (rows < n_rows)[:, None] & (cols < half)[None, :]
    at = (rows * 2 * half)[:, None] + cols[None, :]
    trig = (((rows // (heads * seq)) * seq + rows % seq) * 2 * half)[:, None] + cols[None, :]
    x1 = tl.load(X + at, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(X + at + half, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(COS + trig, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(SIN + trig, mask=ok, other=0.0).to(tl.float32) * SIGN
    tl.store(Y + at, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=ok)
    tl.store(Y + at + half, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=ok)


TILE = 1024  # elements of one half a program rotates: 16 rows of a 128-wide head


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, sign: int) -> Tensor:
    x = x.contiguous()
    batch, heads, seq, dim = x.shape
    y = torch.empty_like(x)
    rows, block = batch * heads * seq, triton.next_power_of_2(dim // 2)
    per_program = max(1, TILE // block)
    _rope_kernel[(triton.cdiv(rows, per_program),)](
        x, cos, sin, y, rows, heads, seq, dim // 2, SIGN=sign, BLOCK=block, ROWS=per_program)
    return y


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor | None, cos: Tensor,
                sin: Tensor) -> tuple[Tensor, Tensor | None]:
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(q, cos, sin, 1), None if k is None else _rotate(k, cos, sin, 1)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor | None) -> tuple[Tensor, Tensor | None, None, None]:
        cos, sin = ctx.saved_tensors
        return (_rotate(dq, cos, sin, -1), None if dk is None else _rotate(dk, cos, sin, -1),
                None, None)


def rope_triton(q: Tensor, k: Tensor | None, cos: Tensor,
                sin: Tensor) -> tuple[Tensor, Tensor | None]:
    return _RoPE.apply(q, k, cos.expand(q.shape[0], -1, -1), sin.expand(q.shape[0], -1, -1))
