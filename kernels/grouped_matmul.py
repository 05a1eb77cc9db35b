"""Grouped matmul for mixture-of-experts layers: rows sorted by expert, each group of rows
times its own expert's matrix, in one call (`torch._grouped_mm`, on CPU and on CUDA from
Hopper on) instead of a Python loop over experts; the loop is the reference and the
fallback where the op does not take the inputs (other devices and dtypes, strides that
are not 16-byte multiples)."""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_matmul_reference(x: Tensor, weights: Tensor, ends: Tensor) -> Tensor:
    """(R, K) rows, grouped by expert in order, times (E, K, N) weights -> (R, N); `ends`
    (E,) int32: where each expert's rows end (cumulative counts)."""
    starts = torch.cat([ends.new_zeros(1), ends[:-1]]).tolist()
    return torch.cat([x[start:end] @ weights[e]
                      for e, (start, end) in enumerate(zip(starts, ends.tolist(), strict=True))])


def _takes(x: Tensor, weights: Tensor) -> bool:
    """Whether `torch._grouped_mm` computes this case here."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weights.dtype:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    aligned = all(size * x.element_size() % 16 == 0 for size in (x.shape[1], weights.shape[2]))
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and aligned


def grouped_matmul(x: Tensor, weights: Tensor, ends: Tensor) -> Tensor:
    """`grouped_matmul_reference`, through one grouped GEMM where the op takes it."""
    if _takes(x, weights):
        return torch._grouped_mm(x, weights, offs=ends)
    return grouped_matmul_reference(x, weights, ends)
