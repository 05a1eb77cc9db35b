"""Rotary position embeddings applied to q and k (HF's rotate-half layout: dimension i
pairs with i + D/2): Triton forward and backward beside the PyTorch reference. The
backward is the inverse rotation, so nothing but cos/sin is saved. On CPU, float32
inference takes the native op of csrc/elementwise_cpu.cpp."""

from __future__ import annotations

import torch
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


def rope_reference(q: Tensor, k: Tensor | None, cos: Tensor,
                   sin: Tensor) -> tuple[Tensor, Tensor | None]:
    return rotate_reference(q, cos, sin), None if k is None else rotate_reference(k, cos, sin)


def rope(q: Tensor, k: Tensor | None, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor | None]:
    """Rotate (B, H, T, D) q and (B, H_kv, T, D) k by (B, T, D) cos/sin (Triton on CUDA,
    native float32 inference on CPU, the reference elsewhere). `k` None rotates q alone (a
    layer attending over another's keys) and returns None for it."""
    if use_triton("rope", q):
        from lathe.kernels.rope_triton import rope_triton
        return rope_triton(q, k, cos, sin)
    if use_native_cpu("rope", q, *(() if k is None else (k,)), cos, sin):
        return rope_cpu(q, cos, sin), None if k is None else rope_cpu(k, cos, sin)
    return rope_reference(q, k, cos, sin)
