"""The native per-row LoRA op (csrc/lora_bgmv_cpu.cpp) adds what its reference adds: each
row its own slot's delta, base rows (slot -1) nothing, at row counts within and past the
slots (the reference's two formulations); a slot holding NaN reaches only its own rows; a
malformed call raises instead of reading out of bounds; and `lora_bgmv` takes it only for
float32 CPU tensors with the kernel enabled."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lathe.kernels.dispatch import kernels_off
from lathe.kernels.lora_bgmv import lora_bgmv, lora_bgmv_cpu, lora_bgmv_reference
from tests.kernels.lora_rows import assert_a_nan_slot_stays_in_its_rows, lora_case

pytestmark = pytest.mark.native_cpu


@pytest.mark.parametrize("rows, slots, rank, d_in, d_out", [
    (1, 1, 8, 64, 96), (3, 4, 16, 128, 384), (16, 4, 8, 384, 1024), (64, 16, 16, 96, 40),
    (7, 2, 3, 17, 33)])
def test_each_row_adds_its_own_slots_delta(rows, slots, rank, d_in, d_out):
    y, x, a, b, scale, row_slots = lora_case(rows, slots, rank, d_in, d_out)
    got = lora_bgmv_cpu(y, x, a, b, scale, row_slots)
    torch.testing.assert_close(got, lora_bgmv_reference(y, x, a, b, scale, row_slots),
                               rtol=1e-5, atol=1e-5)
    for n, slot in enumerate(row_slots[:rows].tolist()):
        want = y[n] if slot < 0 else y[n] + scale[slot] * (x[n] @ a[slot]) @ b[slot]
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-5)
    base = row_slots[:rows] < 0
    assert torch.equal(got[base], y[base])  # copied, not recomputed


@pytest.mark.parametrize("rows", [2, 6])  # within the slots, and past them (the reference)
@pytest.mark.parametrize("op", [lora_bgmv_cpu, lora_bgmv_reference], ids=["native", "reference"])
def test_a_non_finite_slot_reaches_no_other_row(rows, op):
    """An adapter that overflowed leaves the other rows as they are."""
    assert_a_nan_slot_stays_in_its_rows(op, rows)


def test_strided_inputs_are_read_as_their_values():
    y, x, a, b, scale, row_slots = lora_case(5, 3, 4, 24, 20)
    x_t = x.t().contiguous().t()
    torch.testing.assert_close(lora_bgmv_cpu(y, x_t, a, b, scale, row_slots),
                               lora_bgmv_reference(y, x, a, b, scale, row_slots))


def wrong(**changes):
    args = dict(zip(("y", "x", "lora_a", "lora_b", "scale", "row_slots"), lora_case(4, 2, 4, 8, 6),
                    strict=True))
    return tuple({**args, **changes}.values())


@pytest.mark.parametrize("args, message", [
    (wrong(row_slots=torch.tensor([0, 2, 0, 0])), "row 1 names slot 2 of 2"),
    (wrong(row_slots=torch.tensor([0, -2, 0, 0])), "row 1 names slot -2"),
    (wrong(row_slots=torch.tensor([0, 1])), "at least 4 entries"),
    (wrong(row_slots=torch.zeros(4, dtype=torch.int32)), "int64"),
    (wrong(x=torch.zeros(4, 8, dtype=torch.float64)), "x must be a 2-d float32"),
    (wrong(lora_a=torch.zeros(2, 9, 4)), "in=8"),
    (wrong(y=torch.zeros(3, 6)), "y has 3 rows"),
])
def test_malformed_calls_are_refused(args, message):
    with pytest.raises(RuntimeError, match=message):
        lora_bgmv_cpu(*args)


def ran_native(*args: torch.Tensor) -> bool:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = lora_bgmv(*args)
    reference = lora_bgmv_reference(*args)
    torch.testing.assert_close(out, reference, rtol=1e-2 if out.dtype != torch.float32 else 1e-5,
                               atol=1e-2 if out.dtype != torch.float32 else 1e-5)
    return any(event.key == "lathe::lora_bgmv_cpu" for event in prof.key_averages())


def test_lora_bgmv_takes_the_native_op_only_where_it_applies():
    args = lora_case(4, 2, 4, 8, 6)
    assert ran_native(*args)
    assert not ran_native(*(t.bfloat16() if t.is_floating_point() else t for t in args))
    with kernels_off("lora_bgmv"):
        assert not ran_native(*args)


def test_a_compiled_graph_traces_the_reference_where_the_native_op_is_off():
    """The way a CUDA decode step takes it: the dispatch traces whole (no graph break, as
    `fullgraph` demands; inductor's code generation is not what is tested) into the
    reference's gathers, which then equal the native op's answer."""
    args = lora_case(6, 3, 4, 16, 24)  # past the slots: the every-slot formulation
    with kernels_off("lora_bgmv"), profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled = torch.compile(lora_bgmv, fullgraph=True, dynamic=False,
                                 backend="aot_eager")(*args)
    assert not any(event.key == "lathe::lora_bgmv_cpu" for event in prof.key_averages())
    torch.testing.assert_close(compiled, lora_bgmv_cpu(*args), rtol=1e-5, atol=1e-5)
