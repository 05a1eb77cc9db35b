"""Grouped matmul for mixture-of-experts layers: rows sorted by expert, each row times its
own expert's matrix, with no Python loop over experts on the hot path.

Three ways, chosen per call: `torch._grouped_mm` (one grouped GEMM, on CPU and on CUDA
from Hopper on; under torch.compile bf16 only, as its compiled form demands), where the
kernel policy lets it run (`grouped_matmul` in `lathe.kernels.defaults`); where that
does not take the inputs and the rows are few (decode steps), each row's expert matrix
gathered and one batched matmul — no host sync, so compiled and CUDA-graph decode steps
keep it; otherwise the per-expert loop, which is also the reference."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from lathe.kernels.dispatch import DEVICES, kernel_enabled

GATHER_BYTES = 64 * 2**20  # the gathered expert matrices a batched matmul may hold


def grouped_matmul_reference(x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
    """(R, K) rows sorted by their (R,) `experts`, times (E, K, N) weights -> (R, N)."""
    present, counts = experts.unique_consecutive(return_counts=True)
    pieces = x.split(counts.tolist())
    return torch.cat([piece @ weights[e] for e, piece in zip(present.tolist(), pieces,
                                                             strict=True)])


def _takes(x: Tensor, weights: Tensor) -> bool:
    """Whether `torch._grouped_mm` computes this case here, and the policy lets it."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weights.dtype:
        return False
    if x.device.type not in DEVICES or not kernel_enabled("grouped_matmul", x.device.type):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    aligned = all(size * x.element_size() % 16 == 0 for size in (x.shape[1], weights.shape[2]))
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and aligned


@functools.cache
def _loop_outside_graphs() -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The loop as one graph break under torch.compile (its split sizes are data). Made on
    first use there, where torch._dynamo is loaded already: `torch.compiler.disable` as a
    decorator would import it in every process that imports the model, ~1.5 s."""
    return torch.compiler.disable(grouped_matmul_reference)


def grouped_matmul(x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
    """`grouped_matmul_reference`, as one grouped GEMM, a gathered batched matmul, or the
    loop (see the module docstring)."""
    if _takes(x, weights):
        counts = torch.zeros(weights.shape[0], dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, experts, torch.ones_like(experts))  # n slots: a static shape
        return torch._grouped_mm(x, weights, offs=counts.cumsum(0).to(torch.int32))
    gathered = x.shape[0] * weights.shape[1] * weights.shape[2] * weights.element_size()
    if gathered <= GATHER_BYTES:
        return torch.bmm(x[:, None], weights[experts]).squeeze(1)
    if torch.compiler.is_compiling():
        return _loop_outside_graphs()(x, weights, experts)
    return grouped_matmul_reference(x, weights, experts)
