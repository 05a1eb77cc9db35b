"""The LM head and what training computes from it, without the (tokens × vocab) logits.

A 150k–260k vocabulary makes the logits the largest tensor of a training step (8,192 tokens:
5–8.6 GB in fp32, the same again for their gradient). Here the (N, D) final hidden states
go through the (V, D) head a chunk of rows at a time (`chunk_rows`: at most 32M fp32 logits,
128M on a GPU), and each chunk's logits are freed before the next is made. The two
label-driven paths take only the rows that have a label (`labelled_rows`), so a chat's
prompt and padding never reach the head:

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
hidden states' dtype otherwise; the loss math is fp32: a chunk's softmax is one fused pass
from its bf16 logits to fp32 probabilities, and the logits' gradient goes back to bf16 in
the pass that scales it. On CUDA the Triton kernel takes
`linear_cross_entropy`'s place where `kernels/defaults.py` turns it on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from lathe.kernels.dispatch import use_triton

IGNORE_INDEX = -100
CHUNK_ELEMENTS = 1 << 25  # fp32 logits per chunk: 128 MiB, ~220 rows of a 152k vocabulary
# On a GPU every chunk re-reads and re-writes the fp32 (V, D) head gradient (2.5 GB a chunk
# for a 128k × 2,048 head, more than the chunk's matmuls take): fewer, larger chunks
# (512 MiB of logits) amortize it.
CUDA_CHUNK_ELEMENTS = 1 << 27

RowFunction = Callable[[Tensor, slice], Tensor]


def chunk_rows(vocab: int, device: torch.device | None = None) -> int:
    """Rows per chunk for a `vocab`-wide head on `device`."""
    elements = CUDA_CHUNK_ELEMENTS if device is not None and device.type == "cuda" \
        else CHUNK_ELEMENTS
    return max(1, elements // vocab)


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
    keep = labelled_rows(labels, ignore_index)
    if keep is not None:
        hidden, labels = hidden.index_select(0, keep), labels.index_select(0, keep)
    if not (softcap or z_loss) and use_triton("linear_cross_entropy", hidden):
        from lathe.kernels.fused_ce_triton import linear_cross_entropy_triton
        loss = linear_cross_entropy_triton(hidden, weight, labels, ignore_index)
        return loss, loss.new_zeros(())
    chunk = chunk or chunk_rows(weight.shape[0], weight.device)
    objective, z = _CrossEntropy.apply(hidden, weight, labels, ignore_index, softcap,
                                       float(z_loss), chunk)
    count = (labels != ignore_index).sum().clamp(min=1)
    return objective / count, z / count


def linear_token_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor,
                          ignore_index: int = IGNORE_INDEX, *, temperature: float = 1.0,
                          softcap: float | None = None, chunk: int | None = None) -> Tensor:
    """log p(label) per row of (N, D) hidden states from (logits / `temperature`) of the
    (V, D) head, fp32; 0 where the label is `ignore_index`."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive")
    keep = labelled_rows(labels, ignore_index)
    rows, row_labels = (hidden, labels) if keep is None else (
        hidden.index_select(0, keep), labels.index_select(0, keep))
    logps = _TokenLogprobs.apply(rows, weight, row_labels, ignore_index, softcap,
                                 float(temperature),
                                 chunk or chunk_rows(weight.shape[0], weight.device))
    return logps if keep is None else logps.new_zeros(labels.shape[0]).index_copy(0, keep, logps)


def labelled_rows(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor | None:
    """The indices of the rows that have a label, or None when all or none do. The losses
    put only these rows through the head: the rows a loss ignores (a chat's prompt and
    padding, four rows in five in the README run's SFT, DPO and GRPO) would cost a head
    matmul each and add nothing. It costs one host sync (the count). A traced step (the
    memory plan's fake tensors, which have no values) keeps every row."""
    if is_fake(labels):
        return None
    keep = (labels != ignore_index).nonzero()[:, 0]
    return None if keep.numel() in (0, labels.numel()) else keep


def linear_reduce(hidden: Tensor, weight: Tensor, row_function: RowFunction, *,
                  softcap: float | None = None, chunk: int | None = None) -> Tensor:
    """Σ over the rows of (N, D) hidden states of `row_function(logits, rows)`: the rows'
    fp32 logits (rows, V) and their `slice` of the N rows → one value per row."""
    return _Reduce.apply(hidden, weight, row_function, softcap,
                         chunk or chunk_rows(weight.shape[0], weight.device))


def _compute_dtype(hidden: Tensor) -> torch.dtype:
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _logits(h: Tensor, weight: Tensor, softcap: float | None,
            slope: bool) -> tuple[Tensor, Tensor | None]:
    """A chunk's logits — in the head's compute dtype, or capped in fp32 (fp64 from fp64) —
    and d(capped)/d(logits) when capped and `slope` is asked for (a backward needs it; it is
    one more chunk-sized tensor)."""
    logits = h @ weight.T
    if softcap is None:
        return logits, None
    capped = torch.tanh(logits.to(torch.promote_types(h.dtype, torch.float32)).div_(softcap))
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
            else:  # bf16/fp16 products, accumulated in fp32 (no fp32 copy of the product)
                self.grad_weight.add_(grad.T @ self.hidden[rows])


def _softmax(logits: Tensor) -> tuple[Tensor, Tensor]:
    """The rows' softmax in fp32 (fp64 from fp64) and their log-normalizers. From fp32
    logits it is written over them (no second chunk-sized buffer); from bf16 logits it is one
    fused pass into fp32, and lse = max − log(the largest probability) loses nothing, as that
    probability is exp(max − lse) and never below 1/V."""
    math = torch.promote_types(logits.dtype, torch.float32)
    if logits.dtype == math:
        peak = logits.amax(dim=-1)
        probs = logits.sub_(peak[:, None]).exp_()
        total = probs.sum(dim=-1)
        return probs.div_(total[:, None]), peak + total.log()
    peak, where = logits.max(dim=-1)
    probs = torch.softmax(logits, dim=-1, dtype=math)
    return probs, peak.to(math) - probs.gather(1, where[:, None])[:, 0].log()


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
            picked = logits.gather(1, targets[:, None])[:, 0].to(head.math)
            probs, lse = _softmax(logits)
            del logits
            z = lse.square() * valid
            objective += ((lse - picked) * valid).sum() + z_coef * z.sum()
            z_total += z.sum()
            if any(needs):
                head.backward(rows, _cross_entropy_grad(probs, targets, valid,
                                                        (1 + 2 * z_coef * lse) * valid, slope,
                                                        head.dtype))
        ctx.save_for_backward(*(g for g in (head.grad_hidden, head.grad_weight)
                                if g is not None))
        ctx.mark_non_differentiable(z_total)
        ctx.weight_dtype = weight.dtype
        return objective, z_total

    @staticmethod
    def backward(ctx, grad_objective: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:
        return (*_scaled(ctx, grad_objective), None, None, None, None, None)


def _cross_entropy_grad(probs: Tensor, targets: Tensor, valid: Tensor, scale: Tensor,
                        slope: Tensor | None, dtype: torch.dtype) -> Tensor:
    """d/dlogits of the chunk's loss, softmax · scale − one-hot (times the soft cap's slope),
    in `dtype`: the scaling and the cast to a bf16 head are one pass over the chunk, and each
    label's entry is computed in fp32 before its cast (p − 1 rounded to bf16 after p would
    lose a near-certain token's gradient)."""
    label_grad = probs.gather(1, targets[:, None]) * scale[:, None] - valid[:, None].to(
        probs.dtype)
    if slope is not None:
        label_grad.mul_(slope.gather(1, targets[:, None]))
        grad = probs.mul_(scale[:, None]).mul_(slope)
    elif dtype == probs.dtype:
        grad = probs.mul_(scale[:, None])
    else:
        grad = torch.mul(probs, scale[:, None], out=torch.empty_like(probs, dtype=dtype))
    return grad.scatter_(1, targets[:, None], label_grad.to(grad.dtype))


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, row_function: RowFunction,
                softcap: float | None, chunk: int) -> Tensor:
        needs = ctx.needs_input_grad[:2]
        head = _Head(hidden, weight, chunk, needs, _compute_dtype(hidden))
        total = torch.zeros((), device=hidden.device, dtype=head.math)
        for rows in head.chunks():
            logits, slope = head.logits(rows, softcap, slope=any(needs))
            logits = logits.to(head.math)
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


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    """logits / T, in fp32 unless T is 1 (a bf16 quotient would round the logits again)."""
    if temperature == 1.0:
        return logits
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).div_(temperature)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int,
                softcap: float | None, temperature: float, chunk: int) -> Tensor:
        head = _Head(hidden, weight, chunk, (False, False), _compute_dtype(hidden))
        out = torch.empty(hidden.shape[0], device=hidden.device, dtype=head.math)
        for rows in head.chunks():
            logits = _tempered(head.logits(rows, softcap, slope=False)[0], temperature)
            valid, targets = _label_rows(labels[rows], ignore_index)
            picked = logits.gather(1, targets[:, None])[:, 0].to(head.math)
            out[rows] = (picked - _softmax(logits)[1]) * valid
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
            grad = _softmax(_tempered(logits, temperature))[0].mul_(-g[:, None])
            grad.scatter_add_(1, targets[:, None], g[:, None])
            grad.div_(temperature)
            if slope is not None:
                grad.mul_(slope)
            head.backward(rows, grad)
        grad_weight = None if head.grad_weight is None else head.grad_weight.to(weight.dtype)
        return head.grad_hidden, grad_weight, None, None, None, None, None
