"""Sampling transforms on hand-made logits, parameter validation and seeded draws."""

from __future__ import annotations

import math

import pytest
import torch

from lathe.serve.sampling import (
    SamplingError,
    SamplingParams,
    apply_penalties,
    mask_logits,
    sample_token,
)

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625
LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]))


def kept(logits: torch.Tensor) -> list[int]:
    return [i for i, v in enumerate(logits.tolist()) if v != -math.inf]


def test_top_k_top_p_and_min_p_masks():
    assert kept(mask_logits(LOGITS, top_k=2, top_p=1.0, min_p=0.0)) == [0, 1]
    assert kept(mask_logits(LOGITS, top_k=0, top_p=0.5, min_p=0.0)) == [0]
    assert kept(mask_logits(LOGITS, top_k=0, top_p=0.6, min_p=0.0)) == [0, 1]
    assert kept(mask_logits(LOGITS, top_k=0, top_p=0.8, min_p=0.0)) == [0, 1, 2]
    assert kept(mask_logits(LOGITS, top_k=0, top_p=0.01, min_p=0.0)) == [0]  # never empty
    assert kept(mask_logits(LOGITS, top_k=0, top_p=1.0, min_p=0.25)) == [0, 1, 2]
    assert kept(mask_logits(LOGITS, top_k=0, top_p=1.0, min_p=0.3)) == [0, 1]
    assert kept(mask_logits(LOGITS, top_k=4, top_p=0.8, min_p=0.3)) == [0, 1]


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    params = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, params, prompt_ids=[0], output_ids=[1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, params, prompt_ids=[3], output_ids=[2, 2, 0])
    assert out.tolist() == [2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5]  # prompt tokens untouched


def test_greedy_seeded_and_masked_draws():
    assert sample_token(LOGITS, SamplingParams(temperature=0), [], [], None) == 0
    params = SamplingParams(temperature=1.0)
    draws = [sample_token(LOGITS, params, [], [], torch.Generator().manual_seed(7))
             for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same token
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample_token(LOGITS, params, [], [], generator)
                                          for _ in range(4000)]), minlength=5)
    assert torch.allclose(counts / 4000, LOGITS.exp(), atol=0.03)
    top2 = SamplingParams(temperature=1.0, top_k=2)
    assert {sample_token(LOGITS, top2, [], [], generator) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("temperature", 3.0, "in \\[0, 2\\]"), ("top_p", 0.0, "in \\(0, 1\\]"),
    ("max_tokens", 0, ">= 1"), ("n", 17, "in \\[1, 16\\]"), ("min_p", -0.1, "in \\[0, 1\\]"),
])
def test_out_of_range_parameters_name_the_field_and_range(field, value, allowed):
    with pytest.raises(SamplingError, match=f"{field}={value!r} must be {allowed}"):
        SamplingParams(**{field: value})
