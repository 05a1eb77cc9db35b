"""Triton's per-row LoRA kernels (shrink, expand) against `lora_bgmv_reference`: each row its
own slot's delta and base rows (slot -1) copied, at one row (the shrink split over `in`)
and at many, ranks below the padded tile, widths past a tile; a NaN slot reaches only its
own rows, a slot past the slots reads nothing, malformed shapes are refused; and the
dispatch takes them where the policy turns `lora_bgmv` on. Run by the interpreter on CPU,
compiled on a GPU (tests/kernels/target.py)."""

from __future__ import annotations

import pytest
import torch

from lathe.kernels.lora_bgmv import fused_lora_bgmv, lora_bgmv, lora_bgmv_reference
from lathe.kernels.lora_bgmv_triton import lora_bgmv_triton
from tests.kernels.target import DEVICE, DTYPES, enable_kernels

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def case(rows: int, slots: int, rank: int, d_in: int, d_out: int, dtype: torch.dtype,
         seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # the slot vector is longer than the step, as the engine's (the largest bucket's)
    row_slots = torch.randint(-1, slots, (rows + 5,), generator=g)
    tensors = (torch.randn(rows, d_out, generator=g), torch.randn(rows, d_in, generator=g),
               torch.randn(slots, d_in, rank, generator=g) * 0.1,
               torch.randn(slots, rank, d_out, generator=g) * 0.1)
    return (*(t.to(DEVICE, dtype) for t in tensors),
            (torch.rand(slots, generator=g) * 2).to(DEVICE), row_slots.to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, slots, rank, d_in, d_out", [
    (1, 2, 16, 640, 96),  # one row: its `in` split over several shrink programs
    (3, 4, 8, 128, 384), (24, 4, 16, 96, 200), (7, 2, 3, 17, 33)])
def test_each_row_adds_its_own_slots_delta(rows, slots, rank, d_in, d_out, dtype):
    y, x, a, b, scale, row_slots = case(rows, slots, rank, d_in, d_out, dtype)
    got = lora_bgmv_triton(y, x, a, b, scale, row_slots)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got, lora_bgmv_reference(y, x, a, b, scale, row_slots),
                               rtol=tolerance, atol=tolerance)
    for n, slot in enumerate(row_slots[:rows].tolist()):
        want = y[n] if slot < 0 else (y[n].float() + scale[slot] * (
            x[n].float() @ a[slot].float()) @ b[slot].float()).to(dtype)
        torch.testing.assert_close(got[n], want, rtol=tolerance, atol=tolerance)
    base = row_slots[:rows] < 0
    assert torch.equal(got[base], y[base])  # copied, not recomputed


def test_a_non_finite_slot_reaches_no_other_row():
    y, x, a, b, scale, _ = case(6, 3, 2, 8, 6, torch.float32)
    a[0] = float("nan")
    row_slots = torch.tensor([-1, 1, 0, -1, 1, 0], device=DEVICE)
    out = lora_bgmv_triton(y, x, a, b, scale, row_slots)
    for n, slot in enumerate(row_slots.tolist()):
        if slot == 0:
            assert out[n].isnan().all()
            continue
        want = y[n] if slot < 0 else y[n] + scale[1] * (x[n] @ a[1]) @ b[1]
        torch.testing.assert_close(out[n], want)


def test_the_dispatch_takes_the_triton_kernels_where_the_policy_turns_them_on(monkeypatch):
    args = case(4, 2, 4, 32, 48, torch.float32)
    enable_kernels(monkeypatch)
    assert fused_lora_bgmv(*args)
    with torch.profiler.profile() as prof:
        got = lora_bgmv(*args)
    torch.testing.assert_close(got, lora_bgmv_reference(*args))
    # the reference's batched matmuls never ran: the delta came from the kernels
    assert not any(e.key == "aten::bmm" for e in prof.key_averages())


def test_a_slot_past_the_slots_is_read_as_none_not_out_of_bounds():
    """The host cannot check the slots without a sync; the kernels never read past them."""
    y, x, a, b, scale, _ = case(3, 2, 4, 16, 24, torch.float32)
    row_slots = torch.tensor([1, 2, 7], device=DEVICE)
    out = lora_bgmv_triton(y, x, a, b, scale, row_slots)
    torch.testing.assert_close(out[0], y[0] + scale[1] * (x[0] @ a[1]) @ b[1])
    assert torch.equal(out[1:], y[1:])


def wrong(**changes):
    names = ("y", "x", "lora_a", "lora_b", "scale", "row_slots")
    args = dict(zip(names, case(4, 2, 4, 8, 6, torch.float32), strict=True))
    return tuple({**args, **changes}.values())


@pytest.mark.parametrize("args, message", [
    (wrong(row_slots=torch.tensor([0, 1], device=DEVICE)), "at least 4 entries"),
    (wrong(lora_a=torch.zeros(2, 9, 4, device=DEVICE)), "shapes do not chain"),
    (wrong(y=torch.zeros(3, 6, device=DEVICE)), "shapes do not chain"),
    (wrong(scale=torch.ones(3, device=DEVICE)), "shapes do not chain"),
    (wrong(lora_b=torch.zeros(2, 4, 6, device=DEVICE, dtype=torch.float16)), "one dtype"),
    (wrong(x=torch.zeros(4, 2, 4, device=DEVICE)), "must be 2-d"),
])
def test_malformed_calls_are_refused_before_a_kernel_reads(args, message):
    with pytest.raises(ValueError, match=message):
        lora_bgmv_triton(*args)
