"""The LM head and what training computes from it, without the (tokens × vocab) logits.

A 150k–260k vocabulary makes the logits the largest tensor of a training step (8,192 tokens:
5–8.6 GB in fp32, the same again for their gradient). Here the (N, D) final hidden states
go through the (V, D) head a chunk of rows at a time (`chunk_rows`: at most CHUNK_ELEMENTS
fp32 logits), and each chunk's logits are freed before the next is made:

- `linear_cross_entropy`: mean next-token loss (plus PaLM's z-loss, with a soft cap). The
  loss is a scalar, so each chunk's gradient (softmax − one-hot, written over the chunk's
  logits in place) is turned into the hidden states' and the head's gradients in the forward
  itself and the backward only scales them (Liger's fused linear cross-entropy): the head's
  three matmuls run once each, as in the plain reference.
- `linear_token_logprobs`: log p(label) per row at a temperature (DPO, GRPO). Callers
  combine rows non-linearly, so the backward recomputes each chunk's logits (one more head
  matmul) instead of keeping them.
- `linear_reduce`: the sum over rows of any per-row function of a chunk's fp32 logits
  (distillation's divergences), gradients in the forward through autograd on each chunk.

The head computes in the autocast dtype when autocast is on (bf16 on a GPU) and in the
hidden states' dtype otherwise; the loss math is fp32. On CUDA the Triton kernel takes
`linear_cross_entropy`'s place where `kernels/defaults.py` turns it on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lathe.kernels.dispatch import use_triton

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 25  # fp32 logits per chunk: 128 MiB, ~220 rows of a 152k vocabulary

RowFunction = Callable[[Tensor, slice], Tensor]


def chunk_rows(vocab: int) -> int:
    """Rows per chunk for a `vocab`-wide head."""
    return max(1, CHUNK_ELEMENTS // vocab)


def linear_cross_entropy_reference(hidden: Tensor, weight: Tensor, labels: Tensor,
                                   ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy of (N, D) hidden states through the (V, D) head over valid labels,
    through the whole logits (the reference the chunked paths are tested against)."""
    return F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=ignore_index)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor,
                         ignore_index: int = IGNORE_INDEX, *, softcap: float | None = None,
                         z_loss: float = 0.0, chunk: int | None = None
                         ) -> tuple[Tensor, Tensor]:
    """Mean next-token loss of (N, D) hidden states through the (V, D) head over the rows
    whose label is not `ignore_index`, and the mean squared log-normalizer (z). The loss is
    cross-entropy + `z_loss` · z; logits are capped to softcap · tanh(logits / softcap)
    first when `softcap` is set. No rows labelled: 0."""
    if not (softcap or z_loss) and use_triton("linear_cross_entropy", hidden):
        from lathe.kernels.fused_ce_triton import linear_cross_entropy_triton
        loss = linear_cross_entropy_triton(hidden, weight, labels, ignore_index)
        return loss, loss.new_zeros(())
    objective, z = _CrossEntropy.apply(hidden, weight, labels, ignore_index, softcap,
                                       float(z_loss), chunk or chunk_rows(weight.shape[0]))
    count = (labels != ignore_index).sum().clamp(min=1)
    return objective / count, z / count


def linear_token_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor,
                          ignore_index: int = IGNORE_INDEX, *, temperature: float = 1.0,
                          softcap: float | None = None, chunk: int | None = None) -> Tensor:
    """log p(label) per row of (N, D) hidden states from (logits / `temperature`) of the
    (V, D) head, fp32; 0 where the label is `ignore_index`."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive")
    return _TokenLogprobs.apply(hidden, weight, labels, ignore_index, softcap,
                                float(temperature), chunk or chunk_rows(weight.shape[0]))


def linear_reduce(hidden: Tensor, weight: Tensor, row_function: RowFunction, *,
                  softcap: float | None = None, chunk: int | None = None) -> Tensor:
    """Σ over the rows of (N, D) hidden states of `row_function(logits, rows)`: the rows'
    fp32 logits (rows, V) and their `slice` of the N rows → one value per row."""
    return _Reduce.apply(hidden, weight, row_function, softcap,
                         chunk or chunk_rows(weight.shape[0]))


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _logits(h: Tensor, weight: Tensor, softcap: float | None,
            slope: bool) -> tuple[Tensor, Tensor | None]:
    """A chunk's logits in fp32 (fp64 from fp64), and d(capped)/d(logits) when capped and
    `slope` is asked for (a backward needs it; it is one more chunk-sized tensor)."""
    logits = (h @ weight.T).to(torch.promote_types(h.dtype, torch.float32))
    if softcap is None:
        return logits, None
    capped = torch.tanh(logits.div_(softcap))
    derivative = 1 - capped.square() if slope else None
    return capped.mul_(softcap), derivative


class _Head:
    """What the three autograd functions share: the head in its compute dtype, the chunks,
    and turning a chunk's logits gradient into the hidden states' and the head's."""

    def __init__(self, hidden: Tensor, weight: Tensor, chunk: int, needs: tuple[bool, bool],
                 dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.math = torch.promote_types(dtype, torch.float32)  # the loss's dtype
        self.hidden_dtype = hidden.dtype
        self.hidden, self.weight = hidden.to(self.dtype), weight.to(self.dtype)
        self.chunk = chunk
        self.grad_hidden = torch.empty_like(hidden) if needs[0] else None
        self.grad_weight = (torch.zeros(weight.shape, device=weight.device, dtype=self.math)
                            if needs[1] else None)

    def chunks(self) -> list[slice]:
        n = self.hidden.shape[0]
        return [slice(start, min(start + self.chunk, n)) for start in range(0, n, self.chunk)]

    def logits(self, rows: slice, softcap: float | None,
               slope: bool) -> tuple[Tensor, Tensor | None]:
        with torch.autocast(self.hidden.device.type, enabled=False):
            return _logits(self.hidden[rows], self.weight, softcap, slope)

    def backward(self, rows: slice, grad_logits: Tensor) -> None:
        with torch.autocast(self.hidden.device.type, enabled=False):
            grad = grad_logits.to(self.dtype)
            if self.grad_hidden is not None:
                self.grad_hidden[rows] = (grad @ self.weight).to(self.hidden_dtype)
            if self.grad_weight is None:
                return
            if self.dtype == self.math:
                self.grad_weight.addmm_(grad.T, self.hidden[rows])
            else:  # bf16/fp16 products, accumulated in fp32
                self.grad_weight += (grad.T @ self.hidden[rows]).to(self.math)


def _softmax_(logits: Tensor) -> tuple[Tensor, Tensor]:
    """The rows' softmax, written over `logits` (no second chunk-sized buffer), and their
    log-normalizers."""
    peak = logits.amax(dim=-1)
    probs = logits.sub_(peak[:, None]).exp_()
    total = probs.sum(dim=-1)
    return probs.div_(total[:, None]), peak + total.log()


def _label_rows(labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    valid = labels != ignore_index
    return valid, torch.where(valid, labels, 0)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
                softcap: float | None, z_coef: float, chunk: int) -> tuple[Tensor, Tensor]:
        needs = ctx.needs_input_grad[:2]
        head = _Head(hidden, weight, chunk, needs, _compute_dtype(hidden))
        objective = torch.zeros((), device=hidden.device, dtype=head.math)
        z_total = torch.zeros_like(objective)
        for rows in head.chunks():
            logits, slope = head.logits(rows, softcap, slope=any(needs))
            valid, targets = _label_rows(labels[rows], ignore_index)
            picked = logits.gather(1, targets[:, None])[:, 0]
            grad, lse = _softmax_(logits)
            z = lse.square() * valid
            objective += ((lse - picked) * valid).sum() + z_coef * z.sum()
            z_total += z.sum()
            if any(needs):  # d/dlogits: softmax · (1 + 2·z_coef·lse) − one-hot
                grad.mul_(((1 + 2 * z_coef * lse) * valid)[:, None])
                grad.scatter_add_(1, targets[:, None], -valid[:, None].to(grad.dtype))
                if slope is not None:
                    grad.mul_(slope)
                head.backward(rows, grad)
        ctx.save_for_backward(*(g for g in (head.grad_hidden, head.grad_weight)
                                if g is not None))
        ctx.mark_non_differentiable(z_total)
        ctx.weight_dtype = weight.dtype
        return objective, z_total

    @staticmethod
    def backward(ctx, grad_objective: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:
        return (*_scaled(ctx, grad_objective), None, None, None, None, None)


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, row_function: RowFunction,
                softcap: float | None, chunk: int) -> Tensor:
        needs = ctx.needs_input_grad[:2]
        head = _Head(hidden, weight, chunk, needs, _compute_dtype(hidden))
        total = torch.zeros((), device=hidden.device, dtype=head.math)
        for rows in head.chunks():
            logits, slope = head.logits(rows, softcap, slope=any(needs))
            with torch.enable_grad():
                logits.requires_grad_(any(needs))
                value = row_function(logits, rows).sum()
                if any(needs):
                    (grad,) = torch.autograd.grad(value, logits)
                    head.backward(rows, grad if slope is None else grad * slope)
            total += value.detach()
        ctx.save_for_backward(*(g for g in (head.grad_hidden, head.grad_weight)
                                if g is not None))
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor) -> tuple[Tensor | None, ...]:
        return (*_scaled(ctx, grad_total), None, None, None)


def _scaled(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The gradients the forward computed, times the upstream scalar gradient."""
    saved = iter(ctx.saved_tensors)
    grad_hidden = next(saved) * grad if ctx.needs_input_grad[0] else None
    grad_weight = (next(saved) * grad).to(ctx.weight_dtype) if ctx.needs_input_grad[1] \
        else None
    return grad_hidden, grad_weight


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
                softcap: float | None, temperature: float, chunk: int) -> Tensor:
        head = _Head(hidden, weight, chunk, (False, False), _compute_dtype(hidden))
        out = torch.empty(hidden.shape[0], device=hidden.device, dtype=head.math)
        for rows in head.chunks():
            logits, _ = head.logits(rows, softcap, slope=False)
            valid, targets = _label_rows(labels[rows], ignore_index)
            logits.div_(temperature)
            picked = logits.gather(1, targets[:, None])[:, 0]
            out[rows] = (picked - _softmax_(logits)[1]) * valid
        ctx.save_for_backward(hidden, weight, labels)
        ctx.settings = ignore_index, softcap, temperature, chunk, _compute_dtype(hidden)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, labels = ctx.saved_tensors
        ignore_index, softcap, temperature, chunk, dtype = ctx.settings
        head = _Head(hidden, weight, chunk, ctx.needs_input_grad[:2], dtype)
        for rows in head.chunks():
            logits, slope = head.logits(rows, softcap, slope=True)
            valid, targets = _label_rows(labels[rows], ignore_index)
            g = grad_out[rows].to(head.math) * valid
            # d logp / d logits = (one-hot − softmax) / T
            grad = _softmax_(logits.div_(temperature))[0].mul_(-g[:, None])
            grad.scatter_add_(1, targets[:, None], g[:, None])
            grad.div_(temperature)
            if slope is not None:
                grad.mul_(slope)
            head.backward(rows, grad)
        grad_weight = None if head.grad_weight is None else head.grad_weight.to(weight.dtype)
        return head.grad_hidden, grad_weight, None, None, None, None, None
