"""SwiGLU's elementwise core, silu(gate) · up: Triton forward and backward beside the
PyTorch reference, and on CPU the native op of csrc/elementwise_cpu.cpp for float32
inference. The backward recomputes the sigmoid instead of storing it."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from lathe.kernels.cpu_native import use_native_cpu
from lathe.kernels.dispatch import opaque_op, use_triton

swiglu_cpu = opaque_op("swiglu_cpu", "(Tensor gate, Tensor up) -> Tensor", None,
                       lambda gate, up: gate.new_empty(gate.shape))


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) · up (Triton on CUDA, native float32 inference on CPU, the reference
    elsewhere)."""
    if use_triton("swiglu", gate):
        from lathe.kernels.swiglu_triton import swiglu_triton
        return swiglu_triton(gate, up)
    if use_native_cpu("swiglu", gate, up) and gate.shape == up.shape:
        return swiglu_cpu(gate, up)
    return swiglu_reference(gate, up)
