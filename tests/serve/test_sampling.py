"""Sampling transforms on hand-made logits, parameter validation and seeded draws."""

from __future__ import annotations

import math
import re

import pytest
import torch

from lathe.serve.sampling import (
    SamplingBatch,
    SamplingRow,
    apply_penalties,
    mask_logits,
    sample,
    seeded_generator,
)
from lathe.serve.sampling_params import TEMPERATURE_EPSILON, SamplingError, SamplingParams

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625
LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]))


def kept(logits: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(logits.tolist()) if v != -math.inf]


def masked(top_k: int, top_p: float, min_p: float) -> list[int]:
    return kept(mask_logits(LOGITS[None], torch.tensor([top_k]), torch.tensor([top_p]),
                            torch.tensor([min_p]))[0])


def draw(params: SamplingParams, generator: torch.Generator | None = None,
         logits: torch.Tensor = LOGITS) -> int:
    return int(sample(logits[None], SamplingBatch([SamplingRow(params, [], [], generator)],
                                                  "cpu"))[0])


def test_top_k_top_p_and_min_p_masks():
    assert masked(top_k=2, top_p=1.0, min_p=0.0) == [0, 1]
    assert masked(top_k=0, top_p=0.5, min_p=0.0) == [0]
    assert masked(top_k=0, top_p=0.6, min_p=0.0) == [0, 1]
    assert masked(top_k=0, top_p=0.8, min_p=0.0) == [0, 1, 2]
    assert masked(top_k=0, top_p=0.01, min_p=0.0) == [0]  # never empty
    assert masked(top_k=0, top_p=1.0, min_p=0.25) == [0, 1, 2]
    assert masked(top_k=0, top_p=1.0, min_p=0.3) == [0, 1]
    assert masked(top_k=4, top_p=0.8, min_p=0.3) == [0, 1]


def test_masks_apply_per_row_in_one_batch():
    rows = LOGITS.expand(4, -1)
    out = mask_logits(rows, torch.tensor([2, 0, 0, 4]), torch.tensor([1.0, 0.6, 1.0, 0.8]),
                      torch.tensor([0.0, 0.0, 0.3, 0.3]))
    assert [kept(r) for r in out] == [[0, 1], [0, 1], [0, 1], [0, 1]]
    assert kept(mask_logits(rows, torch.tensor([0] * 4), torch.ones(4), torch.zeros(4))[1]) \
        == [0, 1, 2, 3, 4]


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5]])
    rows = [SamplingRow(SamplingParams(repetition_penalty=2.0), [0], [1]),
            SamplingRow(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [3],
                        [2, 2, 0])]
    out = apply_penalties(logits, SamplingBatch(rows, "cpu"))
    assert out[0].tolist() == [1.0, -4.0, 1.0, 0.5]
    assert out[1].tolist() == [2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5]  # prompt tokens untouched
    plain = SamplingBatch([SamplingRow(SamplingParams(), [0], [1])] * 2, "cpu")
    assert torch.equal(apply_penalties(logits, plain), logits)


def test_greedy_seeded_and_masked_draws():
    assert draw(SamplingParams(temperature=0)) == 0
    params = SamplingParams(temperature=1.0)
    draws = [draw(params, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same token
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(params, generator) for _ in range(4000)]),
                            minlength=5)
    assert torch.allclose(counts / 4000, LOGITS.exp(), atol=0.03)
    unseeded = torch.bincount(torch.tensor([draw(params) for _ in range(4000)]), minlength=5)
    assert torch.allclose(unseeded / 4000, LOGITS.exp(), atol=0.03)
    top2 = SamplingParams(temperature=1.0, top_k=2)
    assert {draw(top2, generator) for _ in range(200)} == {0, 1}
    cold = SamplingParams(temperature=0.25)  # p^4: 0.5 -> ~0.94
    assert sum(draw(cold, generator) == 0 for _ in range(400)) > 340


def test_a_seeded_row_draws_the_same_whatever_shares_its_step():
    """One batched draw: greedy rows are the argmax, and each seeded row's token sequence
    is what it gets alone, so batch composition never changes a seeded completion."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.2, top_p=0.9, seed=2), SamplingParams(),
              SamplingParams(temperature=0, repetition_penalty=1.5),
              SamplingParams(temperature=1.0, top_k=5, min_p=0.05, seed=3)]

    def rows(indices):
        return [SamplingRow(params[i], [1, 2], [3], seeded_generator(params[i], "cpu", 0))
                for i in indices]

    together = sample(logits, SamplingBatch(rows(range(6)), "cpu")).tolist()
    for i in (0, 1, 2, 4, 5):
        alone = int(sample(logits[i:i + 1], SamplingBatch(rows([i]), "cpu"))[0])
        assert together[i] == alone, i
    assert together[0] == int(logits[0].argmax())


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("temperature", 3.0, "in \\[0, 2\\]"), ("top_p", 0.0, "in \\(0, 1\\]"),
    ("max_tokens", 0, "in \\[1, 2147483647\\]"), ("n", 17, "in \\[1, 16\\]"),
    ("min_p", -0.1, "in \\[0, 1\\]"), ("top_k", 2**63, "in \\[-1, 2147483647\\]"),
    ("temperature", float("nan"), "in \\[0, 2\\]"), ("seed", 2**64, "in \\[-9223372036854775808"),
    ("stop_token_ids", [-1], "at most 256 token ids, each in \\[0, 2147483647\\]"),
    ("stop_token_ids", list(range(257)), "at most 256 token ids"),
    ("logit_bias", {2**63: 1.0}, "a map of at most 1024 token ids"),
    ("logit_bias", {5: float("inf")}, "a map of at most 1024 token ids"),
])
def test_out_of_range_parameters_name_the_field_and_range(field, value, allowed):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{field: value})
    assert re.match(f"{re.escape(field)}=.* must be {allowed}", str(info.value)), info.value


def test_a_temperature_below_epsilon_is_greedy():
    """1e-40 would scale logits to inf and sample from NaN probabilities (vLLM: greedy)."""
    params = SamplingParams(temperature=1e-40)
    assert params.temperature == 0 and params.greedy
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    assert sample(logits, SamplingBatch([SamplingRow(params, [], [])], "cpu")).tolist() == [1]
    assert SamplingParams(temperature=TEMPERATURE_EPSILON).greedy is False
