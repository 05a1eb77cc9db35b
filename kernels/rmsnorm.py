"""RMSNorm, and residual-add fused with RMSNorm: Triton forward and backward beside the
PyTorch reference, and on CPU the native ops of csrc/elementwise_cpu.cpp for float32
inference.

Semantics are HF Llama's (and `lathe.model.RMSNorm`'s): normalize in fp32, cast back to
the input dtype, then multiply by the weight. The forward keeps 1/rms per row for the
backward; the weight gradient is summed per program, then across programs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lathe.kernels.cpu_native import use_native_cpu
from lathe.kernels.dispatch import opaque_op, use_triton

rms_norm_cpu = opaque_op("rms_norm_cpu", "(Tensor x, Tensor weight, float eps) -> Tensor", None,
                         lambda x, weight, eps: x.new_empty(x.shape))
add_rms_norm_cpu = opaque_op(
    "add_rms_norm_cpu", "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    None, lambda x, residual, weight, eps: (x.new_empty(x.shape), x.new_empty(x.shape)))


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor,
                           eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): a block's residual update and next norm."""
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension (Triton on CUDA, native float32 inference on CPU, the
    reference elsewhere)."""
    if use_triton("rms_norm", x):
        from lathe.kernels.rmsnorm_triton import rms_norm_triton
        return rms_norm_triton(x, weight, eps)
    if use_native_cpu("rms_norm", x, weight):
        return rms_norm_cpu(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over the rows (on CUDA, and for
    float32 inference on CPU)."""
    if use_triton("add_rms_norm", x):
        from lathe.kernels.rmsnorm_triton import add_rms_norm_triton
        return add_rms_norm_triton(x, residual, weight, eps)
    if use_native_cpu("add_rms_norm", x, residual, weight) and residual.shape == x.shape:
        return add_rms_norm_cpu(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)
