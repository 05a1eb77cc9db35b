"""The gated delta rule and its short convolution (Qwen3.5's linear attention): the chunked
form equals the token-by-token recurrence and transformers' own reference, a packed row's
documents each start from zeros as if alone, a state carried across calls continues exactly,
and gradients flow through the chunked form as through the recurrence."""

import pytest
import torch
import torch.nn.functional as F

from lathe.kernels import document_starts
from lathe.kernels.gated_delta import (
    gated_delta_recurrence,
    gated_delta_rule,
    short_convolution,
)

transformers_qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def inputs(batch=2, length=150, key_heads=2, value_heads=4, key_dim=16, value_dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)
    return (randn(batch, length, key_heads, key_dim), randn(batch, length, key_heads, key_dim),
            randn(batch, length, value_heads, value_dim),
            -torch.rand(batch, length, value_heads, generator=generator) * 0.5,
            torch.rand(batch, length, value_heads, generator=generator))


@pytest.mark.parametrize("length", [1, 37, 64, 150])
def test_chunked_rule_equals_the_recurrence_and_transformers(length):
    q, k, v, g, beta = inputs(length=length)
    state = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(1)) * 0.1
    theirs, their_state = transformers_qwen3_5.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    for rule in (gated_delta_rule, gated_delta_recurrence):
        out, final = rule(q, k, v, g, beta, state=state)
        assert (out - theirs).abs().max() < 1e-5
        assert (final - their_state).abs().max() < 1e-5


def test_a_packed_rows_documents_each_start_from_zero():
    q, k, v, g, beta = inputs()
    # documents crossing chunk edges, one exactly at a chunk's start, one a token long
    documents = torch.tensor([[0] * 40 + [1] * 24 + [2] * 85 + [3],
                              [0] * 64 + [1] * 86])
    starts = document_starts(documents)
    chunked, _ = gated_delta_rule(q, k, v, g, beta, starts=starts)
    stepped, _ = gated_delta_recurrence(q, k, v, g, beta, starts=starts)
    for row in range(2):
        for doc in documents[row].unique():
            at = (documents[row] == doc).nonzero().squeeze(1)
            alone, _ = gated_delta_rule(*(x[row:row + 1, at] for x in (q, k, v, g, beta)))
            assert (chunked[row:row + 1, at] - alone).abs().max() < 1e-5
            assert (stepped[row:row + 1, at] - alone).abs().max() < 1e-5
    whole, _ = gated_delta_rule(q, k, v, g, beta)
    assert (whole - chunked).abs().max() > 1e-2  # the documents did read each other before


def test_a_carried_state_continues_a_sequence_exactly():
    q, k, v, g, beta = inputs()
    whole, final = gated_delta_rule(q, k, v, g, beta)
    first, state = gated_delta_rule(*(x[:, :90] for x in (q, k, v, g, beta)))
    rest, after = gated_delta_rule(*(x[:, 90:] for x in (q, k, v, g, beta)), state=state)
    token, _ = gated_delta_recurrence(*(x[:, 90:91] for x in (q, k, v, g, beta)), state=state)
    assert (torch.cat((first, rest), 1) - whole).abs().max() < 1e-5
    assert (after - final).abs().max() < 1e-5
    assert (token - rest[:, :1]).abs().max() < 1e-5


def test_gradients_of_the_chunked_rule_are_the_recurrences():
    leaves = [x.double().requires_grad_() for x in inputs(length=70)]
    weight = torch.randn(2, 70, 4, 8, dtype=torch.float64)
    grads = []
    for rule in (gated_delta_rule, gated_delta_recurrence):
        out, _ = rule(*leaves)
        grads.append(torch.autograd.grad((out * weight).sum(), leaves))
    for ours, reference in zip(*grads, strict=True):
        assert (ours - reference).abs().max() < 1e-5 * reference.abs().max()


def test_value_heads_must_be_a_multiple_of_key_heads():
    q, k, v, g, beta = inputs(value_heads=3)
    with pytest.raises(ValueError, match="3 value heads are not a multiple of 2 key heads"):
        gated_delta_rule(q, k, v, g, beta)


def test_short_convolution_is_the_depthwise_causal_conv_and_carries_its_inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 50, 12, generator=generator)
    weight = torch.randn(12, 4, generator=generator)
    expected = F.silu(F.conv1d(x.transpose(1, 2), weight[:, None], padding=3, groups=12)
                      [..., :50]).transpose(1, 2)
    out, _ = short_convolution(x, weight)
    assert (out - expected).abs().max() < 1e-5
    first, state = short_convolution(x[:, :31], weight)
    rest, _ = short_convolution(x[:, 31:], weight, state=state)
    assert (torch.cat((first, rest), 1) - expected).abs().max() < 1e-5
    documents = torch.tensor([[0] * 20 + [1] * 30] * 2)
    packed, _ = short_convolution(x, weight, starts=document_starts(documents))
    alone, _ = short_convolution(x[:, 20:], weight)
    assert (packed[:, 20:] - alone).abs().max() < 1e-5
    assert (packed[:, :20] - expected[:, :20]).abs().max() < 1e-5
