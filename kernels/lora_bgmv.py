"""Each row's own LoRA adapter added to a projection's output at a fixed shape (Punica's
BGMV), as a compiled decode step with adapter slots computes it: `lathe::lora_bgmv_cpu`
(csrc/lora_bgmv_cpu.cpp) for float32 on CPU once the native kernels are loaded, Triton's
shrink and expand (`lora_bgmv_triton`) on CUDA where the kernel policy turns them on, and
their reference `lora_bgmv_reference`, which the step traces everywhere else.

Row n adds scale[s] · (x[n] · A[s]) · B[s], s = row_slots[n]; a row of slot -1 (the base
model's, or padding) gets nothing. A (slots × in × rank) and B (slots × rank × out) are the
slots' adapters stored transposed (`lathe.serve.adapters.MultiLoraLinear`). The reference
gathers each row's own A and B where the rows are at most the slots, else multiplies every
slot's A over all rows and keeps each row's own rank-wide slice. Traced into a CPU graph,
that was kernels of inductor's own in every projection of every layer, and the graphs
took 2.6-4.4× as long to build as the base's; the native op is one call a projection.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lathe.kernels.cpu_native import native_kernel
from lathe.kernels.dispatch import opaque_op, use_triton

lora_bgmv_cpu = opaque_op(
    "lora_bgmv_cpu",
    "(Tensor y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor scale, Tensor row_slots) "
    "-> Tensor", None, lambda y, *rest: torch.empty_like(y))


def lora_bgmv_reference(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor,
                        row_slots: Tensor) -> Tensor:
    """(rows, out) `y` plus each (rows, in) `x` row's own adapter delta, in y's dtype."""
    x = x.to(lora_a.dtype)
    index = row_slots[:x.shape[0]]
    slot = index.clamp(min=0)
    slots, _, rank = lora_a.shape
    # rows are selected with `where`, never multiplied by a 0/1 mask: another slot's NaN or
    # Inf times 0 is NaN, and would reach every row of the batch
    if x.shape[0] <= slots:  # each row's own A and B
        h = torch.bmm(x[:, None], lora_a[slot])
        delta = torch.bmm(h, lora_b[slot])[:, 0]
    else:  # every slot's A once, then each row's rank-r slice on its B
        h = torch.einsum("ni,sir->nsr", x, lora_a)
        mine = torch.nn.functional.one_hot(slot, slots).bool()
        h = torch.where(mine[..., None], h, 0).view(-1, slots * rank)
        delta = h @ lora_b.view(slots * rank, lora_b.shape[-1])
    delta = torch.where((index >= 0)[:, None], delta * scale[slot][:, None], 0)
    return y + delta.to(y.dtype)


def native_lora_bgmv(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor,
                     row_slots: Tensor) -> bool:
    """Whether `lora_bgmv` takes the native op for these tensors."""
    return (native_kernel("lora_bgmv", y) and row_slots.device.type == "cpu"
            and all(t.dtype == torch.float32 for t in (y, x, lora_a, lora_b, scale)))


def fused_lora_bgmv(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor,
                    row_slots: Tensor) -> Tensor | None:
    """`lora_bgmv_reference`'s answer by a kernel, Triton's or the native op, where one
    applies; None where only the reference does."""
    if use_triton("lora_bgmv", y):
        from lathe.kernels.lora_bgmv_triton import lora_bgmv_triton
        return lora_bgmv_triton(y, x, lora_a, lora_b, scale, row_slots)
    if native_lora_bgmv(y, x, lora_a, lora_b, scale, row_slots):
        return lora_bgmv_cpu(y, x, lora_a, lora_b, scale, row_slots)
    return None


def lora_bgmv(y: Tensor, x: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor,
              row_slots: Tensor) -> Tensor:
    """`lora_bgmv_reference`'s answer, by a kernel where one applies."""
    fused = fused_lora_bgmv(y, x, lora_a, lora_b, scale, row_slots)
    return fused if fused is not None else lora_bgmv_reference(y, x, lora_a, lora_b, scale,
                                                               row_slots)
