"""W8A8 FP8 matmuls, as compressed-tensors' FP8_DYNAMIC scheme defines them and vLLM and
transformers compute them: the weight is float8 e4m3 with one float32 scale per output row
(w ≈ q · scale[n]); each token's input row is rounded to float8 by its own scale, max|x| /
448, before the two meet.

On a GPU with FP8 tensor cores (compute capability 8.9 and up: Ada, Hopper, Blackwell) the
product is `torch._scaled_mm`, cuBLASLt's FP8 GEMM with a scale per row of x and per column
of wᵀ, the weight never widened. On the CPU, where torch's FP8 GEMM is 30-50× slower than its
float32 one, the weight is widened once to bfloat16 (exact: every e4m3 value is a bfloat16)
and multiplied through `lathe.kernels.decode_linear.linear` — the native op for half weights
— and the scales are applied after the sum; elsewhere the reference runs, which dequantizes
both sides first."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lathe.kernels.decode_linear import linear as half_weight_linear

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def fp8_scales(x: Tensor) -> Tensor:
    """One float32 scale per row of `x` (its last dimension reduced, kept as size 1):
    max|row| / 448 (compressed-tensors' `calculate_qparams`). An all-zero row, which the
    library gives float32's eps, gets float32's smallest normal: either way its values round
    to zero, and three ops a call (an eager decode step makes ~100) beat six."""
    scale = torch.linalg.vector_norm(x.detach(), float("inf"), dim=-1, keepdim=True,
                                     dtype=torch.float32) / FP8_MAX
    return scale.clamp_min_(torch.finfo(torch.float32).tiny)


def to_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale, clamped to ±448 and rounded to the nearest e4m3 value."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_fp8_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """`weight` (out, in) as float8 rows and their (out,) float32 scales."""
    scale = fp8_scales(weight)
    return to_fp8(weight, scale), scale.squeeze(-1)


def fp8_matmul_reference(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """x @ (weight · scale)ᵀ in float32, each row of x first rounded to float8 by its own
    scale; in x's dtype."""
    rows = x.float()
    row_scale = fp8_scales(rows)
    rows = to_fp8(rows, row_scale).float() * row_scale
    return F.linear(rows, weight.float() * scale.float()[:, None]).to(x.dtype)


def uses_tensor_cores(x: Tensor, weight: Tensor) -> bool:
    """Whether `fp8_matmul` takes cuBLASLt's FP8 GEMM for these operands: a GPU of compute
    capability ≥ 8.9, a bf16 x (the row-wise scaled GEMM's output is bf16 only), both sides'
    widths multiples of 16. Otherwise it wants the weight widened."""
    return (x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0)


def fp8_matmul(x: Tensor, weight: Tensor, scale: Tensor, widened: Tensor | None = None) -> Tensor:
    """`fp8_matmul_reference`'s product, computed as the device allows: on FP8 tensor cores
    (`uses_tensor_cores`); else through `widened`, the weight as bfloat16, the scales applied
    after the sum (on the CPU a float32 x takes the native half-weight op); the reference
    without it."""
    row_scale = fp8_scales(x)
    if uses_tensor_cores(x, weight):
        rows, row_scale = x.reshape(-1, x.shape[-1]), row_scale.reshape(-1, 1)
        y = torch._scaled_mm(to_fp8(rows, row_scale), weight.t(), scale_a=row_scale,
                             scale_b=scale.float()[None, :], out_dtype=x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])
    if widened is None:
        return fp8_matmul_reference(x, weight, scale)
    y = half_weight_linear(to_fp8(x, row_scale).to(x.dtype), widened)
    return (y.float() * row_scale * scale).to(x.dtype)
