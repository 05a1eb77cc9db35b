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
from tests.kernels.lora_rows import assert_a_nan_slot_stays_in_its_rows, lora_case
from tests.kernels.target import DEVICE, DTYPES, enable_kernels

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, slots, rank, d_in, d_out", [
    (1, 2, 16, 640, 96),  # one row: its `in` split over several shrink programs
    (3, 4, 8, 128, 384), (24, 4, 16, 96, 200), (7, 2, 3, 17, 33)])
def test_each_row_adds_its_own_slots_delta(rows, slots, rank, d_in, d_out, dtype):
    y, x, a, b, scale, row_slots = lora_case(rows, slots, rank, d_in, d_out, dtype, DEVICE)
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
    assert_a_nan_slot_stays_in_its_rows(lora_bgmv_triton, 6, DEVICE)


def test_the_dispatch_takes_the_triton_kernels_where_the_policy_turns_them_on(monkeypatch):
    args = lora_case(4, 2, 4, 32, 48, device=DEVICE)
    enable_kernels(monkeypatch)
    assert fused_lora_bgmv(*args) is not None
    with torch.profiler.profile() as prof:
        got = lora_bgmv(*args)
    torch.testing.assert_close(got, lora_bgmv_reference(*args))
    # the reference's batched matmuls never ran: the delta came from the kernels
    assert not any(e.key == "aten::bmm" for e in prof.key_averages())


def test_a_slot_past_the_slots_is_read_as_none_not_out_of_bounds():
    """The host cannot check the slots without a sync; the kernels never read past them."""
    y, x, a, b, scale, _ = lora_case(3, 2, 4, 16, 24, device=DEVICE)
    row_slots = torch.tensor([1, 2, 7], device=DEVICE)
    out = lora_bgmv_triton(y, x, a, b, scale, row_slots)
    torch.testing.assert_close(out[0], y[0] + scale[1] * (x[0] @ a[1]) @ b[1])
    assert torch.equal(out[1:], y[1:])


def wrong(**changes):
    names = ("y", "x", "lora_a", "lora_b", "scale", "row_slots")
    args = dict(zip(names, lora_case(4, 2, 4, 8, 6, device=DEVICE), strict=True))
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
