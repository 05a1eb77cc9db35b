"""Packed rows (`documents=`): several documents in one row compute what each computes
alone — logits, loss and gradients (fp64) — with positions restarting per document,
under the families' attention variants too; no token sees another document."""

from __future__ import annotations

import pytest
import torch

from lathe.model.transformer import IGNORE_INDEX
from tests.builders import tiny_model

LENGTHS = (5, 11, 1, 15)  # one row of 32 tokens: four documents, one of a single token


def packed_row(lengths=LENGTHS, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (sum(lengths),), generator=g)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return ids[None], documents[None]


def pieces(tensor, lengths=LENGTHS):
    return torch.split(tensor, list(lengths), dim=1)


@pytest.mark.parametrize("overrides", [
    {},
    {"family": "mistral", "sliding_window": 4},  # a window inside each document
    {"family": "gemma2", "attn_softcap": 5.0, "query_pre_attn_scalar": 24, "final_softcap": 3.0,
     "sliding_window": 6, "n_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
], ids=["llama", "window", "gemma-softcap"])
def test_packed_row_logits_equal_each_document_alone(overrides):
    # soft-capped scores take their softmax in fp32, as transformers' eager attention does
    tolerance = 1e-6 if "attn_softcap" in overrides else 1e-10
    model = tiny_model(**overrides).double()
    ids, documents = packed_row()
    with torch.no_grad():
        packed = model(ids, documents=documents).logits
        for piece, logits in zip(pieces(ids), pieces(packed), strict=True):
            torch.testing.assert_close(logits, model(piece).logits, atol=tolerance,
                                       rtol=tolerance)


def test_packed_loss_and_gradients_equal_the_examples_one_by_one():
    """The loss of a packed row over its labelled tokens (each document's first label
    ignored) equals the token-weighted mean over the documents run alone, and so do the
    gradients (fp64 ≤ 1e-6)."""
    model = tiny_model().double().train()
    ids, documents = packed_row()
    labels = ids.clone()
    starts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0)[:-1].tolist()])
    labels[0, starts] = IGNORE_INDEX
    model(ids, labels=labels, documents=documents).loss.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total_tokens = sum(n - 1 for n in LENGTHS)
    for piece in pieces(ids):
        if piece.shape[1] < 2:
            continue
        loss = model(piece, labels=piece).loss * (piece.shape[1] - 1) / total_tokens
        loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed[name], param.grad, atol=1e-6, rtol=1e-6, msg=name)


def test_no_token_attends_across_documents():
    """Changing one document's tokens changes the logits of that document alone (fp32
    inference: the native CPU RoPE rotates by the restarted positions too)."""
    model = tiny_model()
    ids, documents = packed_row()
    changed = ids.clone()
    changed[0, 5:16] = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        before = model(ids, documents=documents).logits
        after = model(changed, documents=documents).logits
        for piece, logits in zip(pieces(ids), pieces(before), strict=True):
            torch.testing.assert_close(logits, model(piece).logits, atol=1e-5, rtol=1e-5)
    moved = (before - after).abs().amax(-1)[0] > 0
    assert moved[5:16].all()
    assert not moved[:5].any() and not moved[16:].any()


def test_documents_refuse_a_kv_cache():
    from lathe.model.kv_cache import ContiguousKVCache

    model = tiny_model()
    ids, documents = packed_row()
    cache = ContiguousKVCache(model.config, batch_size=1, max_len=64)
    with pytest.raises(ValueError, match="packed rows"):
        model(ids, documents=documents, kv_cache=cache)
