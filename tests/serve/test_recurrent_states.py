"""A step's linear-attention batches (`StateSpans`): sequences run together — those of one
length that continue from their states, fresh ones, decodes — compute what each computes
alone, outputs and states; snapshots are the states at their boundary."""

from __future__ import annotations

import torch

from lathe.model import ModelConfig, Transformer
from lathe.serve.recurrent_states import RecurrentStates, StateSpans

LENGTHS = (40, 40, 38, 36, 1, 1)  # the first two together; two decodes
FRESH = (False, False, True, False, False, True)


def setup():
    torch.manual_seed(0)
    config = ModelConfig.from_preset("tiny", family="qwen3_5_text")
    layer = Transformer(config).model.layers[0].linear_attn
    states = RecurrentStates(config, len(LENGTHS), torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(1)
    for table in (states.conv, states.state):
        table[0].copy_(torch.randn(table[0].shape, generator=generator))
    total = sum(LENGTHS)
    inputs = (torch.randn(1, total, config.linear_conv_channels, generator=generator),
              torch.rand(1, total, config.linear_value_heads, generator=generator),
              -torch.rand(1, total, config.linear_value_heads, generator=generator))
    return layer, states, inputs


def alone(layer, states, inputs, start, length, row, fresh, cut=None):
    """One sequence's output and states, run by itself (to `cut` tokens, when given)."""
    end = start + (cut or length)
    pieces = tuple(t[:, start:end] for t in inputs)
    before = None if fresh else (states.conv[0][row:row + 1].clone(),
                                 states.state[0][row:row + 1].clone())
    out, (conv, state) = layer.mix(pieces, before)
    return out[0], conv[0], state[0]


def spans_of(cuts=None):
    spans, at = [], 0
    for row, (length, fresh) in enumerate(zip(LENGTHS, FRESH, strict=True)):
        spans.append((at, length, row, fresh, (cuts or {}).get(row, ())))
        at += length
    return spans


def test_a_steps_batches_compute_what_each_sequence_computes_alone():
    layer, states, inputs = setup()
    expected = []
    for at, length, row, fresh, _ in spans_of():
        expected.append(alone(layer, states, inputs, at, length, row, fresh))
    step = StateSpans(states, spans_of())
    assert max(len(rows) for _, _, rows, *_ in step.rounds[0]) == 2
    out = step.run(0, inputs, layer.mix)
    for (at, length, row, _, _), (want, conv, state) in zip(spans_of(), expected,
                                                            strict=True):
        torch.testing.assert_close(out[0, at:at + length], want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(states.conv[0][row], conv, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(states.state[0][row], state, rtol=1e-4, atol=1e-5)


def test_a_snapshot_is_the_state_at_its_boundary():
    """A chunk snapshotted before its end keeps its states after `cut` tokens, and runs on
    from them to the same end as uncut."""
    layer, states, inputs = setup()
    at, length, row, fresh, _ = spans_of()[1]
    _, conv, state = alone(layer, states, inputs, at, length, row, fresh, cut=32)
    _, end_conv, end_state = alone(layer, states, inputs, at, length, row, fresh)
    step = StateSpans(states, spans_of({1: (16, 32)}))
    step.run(0, inputs, layer.mix)
    assert len(step.rounds) == 3  # its pieces 16, 16 and 5 tokens
    kept_conv, kept_state = step.captured[(1, 32)][0]
    torch.testing.assert_close(kept_conv, conv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kept_state, state, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states.state[0][1], end_state, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states.conv[0][1], end_conv, rtol=1e-5, atol=1e-6)


def test_a_drafted_rows_states_settle_after_its_accepted_tokens():
    """A speculative step's drafted sequence runs keeping its states after each token; told
    how many of them stand (its last token and the drafts accepted), the row holds the
    states after those, as if the rejected drafts had never run."""
    layer, states, inputs = setup()
    at, length, row, fresh, _ = spans_of()[3]  # 36 tokens: the last token and 35 "drafts"
    _, conv, state = alone(layer, states, inputs, at, length, row, fresh, cut=3)
    want, *_ = alone(layer, states, inputs, at, length, row, fresh)
    step = StateSpans(states, spans_of(), drafted=frozenset({row}))
    out = step.run(0, inputs, layer.mix)
    torch.testing.assert_close(out[0, at:at + length], want, rtol=1e-4, atol=1e-5)
    step.settle(row, 3)
    torch.testing.assert_close(states.conv[0][row], conv, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(states.state[0][row], state, rtol=1e-4, atol=1e-5)
