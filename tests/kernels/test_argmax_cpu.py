"""The native greedy pick (csrc/argmax_cpu.cpp) answers exactly what torch.argmax does: the
first maximum of each row (ties across vector lanes and in the tail), the first NaN of a row
holding one, at vocabulary sizes that are and are not whole vectors; and `greedy_argmax`
takes it only for float32 CPU logits with the kernel enabled."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lathe.kernels.argmax import argmax_cpu, greedy_argmax
from lathe.kernels.dispatch import kernels_off

pytestmark = pytest.mark.native_cpu



@pytest.mark.parametrize("rows", [1, 3, 16, 65])
@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 4096, 4099])
def test_matches_torch_argmax(rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(argmax_cpu(logits), logits.argmax(dim=-1))


def test_ties_answer_the_first_maximum():
    logits = torch.zeros(6, 100)
    logits[1, [3, 19, 35, 99]] = 5.0  # the same lane of three vectors, and the tail
    logits[2, [98, 40]] = 5.0  # a later lane first in the row's vector part
    logits[3, [99, 97]] = 5.0  # both in the tail
    logits[4] = float("-inf")
    logits[5, [20, 4]] = float("inf")
    assert argmax_cpu(logits).tolist() == [0, 3, 40, 97, 0, 4]
    assert torch.equal(argmax_cpu(logits), logits.argmax(dim=-1))


def test_a_nan_answers_the_first_nan():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    logits[0, 30] = float("nan")
    logits[0, 31] = 1e9
    logits[1, 49] = float("nan")  # in the tail
    logits[2, [40, 5]] = float("nan")
    assert argmax_cpu(logits).tolist()[:3] == [30, 49, 5]
    assert torch.equal(argmax_cpu(logits), logits.argmax(dim=-1))


def test_strided_logits_are_read_as_their_values():
    logits = torch.randn(40, 8, generator=torch.Generator().manual_seed(1)).t()
    assert torch.equal(argmax_cpu(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("logits, message", [
    (torch.zeros(2, 8, dtype=torch.float64), "float32"),
    (torch.zeros(8), "float32 \\(rows, vocab\\)"),
    (torch.zeros(2, 0), "1 to 2\\^24"),
])
def test_wrong_inputs_are_refused(logits, message):
    with pytest.raises(RuntimeError, match=message):
        argmax_cpu(logits)


def ran_native(logits: torch.Tensor) -> bool:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = greedy_argmax(logits)
    assert torch.equal(out, logits.argmax(dim=-1))
    return any(event.key == "lathe::argmax_cpu" for event in prof.key_averages())


def test_greedy_argmax_takes_the_native_op_only_where_it_applies():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    assert ran_native(logits)
    assert not ran_native(logits.bfloat16())
    with kernels_off("argmax"):
        assert not ran_native(logits)
