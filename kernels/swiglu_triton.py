"""The Triton forward and backward of SwiGLU's elementwise core (`lathe.kernels.swiglu`
holds the reference and imports this module only on the Triton path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024


@triton.jit
def _swiglu_forward(G, U, Y, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    g = tl.load(G + offsets, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offsets, mask=ok, other=0.0).to(tl.float32)
    silu = g * tl.sigmoid(g)
    tl.store(Y + offsets, (silu * u).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_backward(G, U, DY, DG, DU, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    g = tl.load(G + offsets, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offsets, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + offsets, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DU + offsets, (dy * silu).to(DU.dtype.element_ty), mask=ok)
    dsilu = sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + offsets, (dy * u * dsilu).to(DG.dtype.element_ty), mask=ok)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        _swiglu_forward[(triton.cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _swiglu_backward[(triton.cdiv(n, BLOCK),)](gate, up, dy.contiguous(), dgate, dup, n,
                                                   BLOCK=BLOCK)
        return dgate, dup


def swiglu_triton(gate: Tensor, up: Tensor) -> Tensor:
    return _SwiGLU.apply(gate, up)
