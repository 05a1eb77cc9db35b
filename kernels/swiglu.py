"""SwiGLU's elementwise core, silu(gate) · up: Triton forward and backward beside the
PyTorch reference, and on CPU the native op of csrc/elementwise_cpu.cpp for float32
inference. The backward recomputes the sigmoid instead of storing it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from lathe.kernels.cpu_native import use_native_cpu
from lathe.kernels.dispatch import opaque_op, use_triton

BLOCK = 1024

swiglu_cpu = opaque_op("swiglu_cpu", "(Tensor gate, Tensor up) -> Tensor", None,
                       lambda gate, up: gate.new_empty(gate.shape))


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


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


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) · up (Triton on CUDA, native float32 inference on CPU, the reference
    elsewhere)."""
    if use_triton("swiglu", gate):
        return swiglu_triton(gate, up)
    if use_native_cpu("swiglu", gate, up) and gate.shape == up.shape:
        return swiglu_cpu(gate, up)
    return swiglu_reference(gate, up)
