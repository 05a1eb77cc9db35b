"""The Triton half of the fused linear + cross-entropy (`lathe.kernels.fused_ce` holds
the reference and imports this module only on the Triton path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lathe.kernels.fused_ce import IGNORE_INDEX


@triton.jit
def _cross_entropy_rows(LOGITS, LABELS, LOSS, n_rows, vocab, scale, ignore_index,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < n_rows:
            base = LOGITS + row.to(tl.int64) * vocab
            label = tl.load(LABELS + row)
            running_max = -float("inf")
            total = 0.0
            for v0 in range(0, vocab, BLOCK):
                x = tl.load(base + v0 + cols, mask=v0 + cols < vocab, other=-float("inf"))
                new_max = tl.maximum(running_max, tl.max(x, axis=0))
                total = total * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max),
                                                                       axis=0)
                running_max = new_max
            lse = running_max + tl.log(total)
            valid = label != ignore_index
            target = tl.load(base + label, mask=valid, other=0.0)
            tl.store(LOSS + row, tl.where(valid, lse - target, 0.0))
            for v0 in range(0, vocab, BLOCK):
                ok = v0 + cols < vocab
                x = tl.load(base + v0 + cols, mask=ok, other=0.0)
                grad = tl.exp(x - lse) - tl.where(v0 + cols == label, 1.0, 0.0)
                tl.store(base + v0 + cols, tl.where(valid, grad * scale, 0.0), mask=ok)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
                chunk: int) -> Tensor:
        n, vocab = hidden.shape[0], weight.shape[0]
        valid = int((labels != ignore_index).sum())
        scale = 1.0 / max(valid, 1)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        losses = torch.empty(n, device=hidden.device, dtype=torch.float32)
        block = min(triton.next_power_of_2(vocab), 4096)
        for start in range(0, n, chunk):
            h = hidden[start:start + chunk]
            logits = (h @ weight.T).float().contiguous()  # becomes the gradient in place
            rows = logits.shape[0]
            _cross_entropy_rows[(triton.cdiv(rows, 4),)](
                logits, labels[start:start + chunk].contiguous(), losses[start:start + chunk],
                rows, vocab, scale, ignore_index, BLOCK=block, ROWS=4)
            grad_hidden[start:start + chunk] = (logits.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight += logits.T @ h.float()
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return losses.sum() * scale

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None


def linear_cross_entropy_triton(hidden: Tensor, weight: Tensor, labels: Tensor,
                                ignore_index: int = IGNORE_INDEX, chunk: int = 1024) -> Tensor:
    return _LinearCrossEntropy.apply(hidden.contiguous(), weight, labels, ignore_index, chunk)
