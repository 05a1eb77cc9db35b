"""Inputs and a check shared by the tests of the per-row LoRA kernels (the native op and
Triton's): each row's own slot, base rows at slot -1."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def lora_case(rows: int, slots: int, rank: int, d_in: int, d_out: int,
              dtype: torch.dtype = torch.float32, device: str = "cpu",
              seed: int = 0) -> tuple[Tensor, ...]:
    """(y, x, lora_a, lora_b, scale, row_slots), the slot vector longer than the step, as
    the engine's (the largest bucket's)."""
    g = torch.Generator().manual_seed(seed)
    row_slots = torch.randint(-1, slots, (rows + 5,), generator=g)
    tensors = (torch.randn(rows, d_out, generator=g), torch.randn(rows, d_in, generator=g),
               torch.randn(slots, d_in, rank, generator=g) * 0.1,
               torch.randn(slots, rank, d_out, generator=g) * 0.1)
    return (*(t.to(device, dtype) for t in tensors),
            (torch.rand(slots, generator=g) * 2).to(device), row_slots.to(device))


def assert_a_nan_slot_stays_in_its_rows(op: Callable[..., Tensor], rows: int,
                                        device: str = "cpu") -> None:
    """Slot 0 holds NaN: its rows are NaN, the base rows and slot 1's exact as they were
    meant — a 0/1 mask multiplied in had turned every row of the batch into NaN."""
    y, x, a, b, scale, _ = lora_case(rows, 3, 2, 8, 6, device=device)
    a[0] = float("nan")
    row_slots = torch.tensor([-1, 1, 0, -1, 1, 0][:rows], device=device)
    out = op(y, x, a, b, scale, row_slots)
    for n, slot in enumerate(row_slots.tolist()):
        if slot == 0:
            assert out[n].isnan().all()
            continue
        want = y[n] if slot < 0 else y[n] + scale[1] * (x[n] @ a[1]) @ b[1]
        torch.testing.assert_close(out[n], want)
