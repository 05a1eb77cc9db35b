"""The model's chunked head (`Transformer.chunked_head`) computes what its whole-logits path
computes — the loss with z-loss, the head ops the stages use (label log-probabilities at a
temperature, distillation's loss) — with the same gradients, on a soft-capped head and a
mixture of experts too; and what the head ops give equals what the stages computed before
from the logits."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from lathe.model.head_ops import LabelLogprobs
from lathe.model.lora import LoraSection, apply_lora
from lathe.posttrain.divergence import DistillationLoss, kd_loss
from tests.builders import tiny_model

CASES = {"plain": {}, "softcap": {"family": "gemma2", "final_softcap": 5.0},
         "moe": {"family": "qwen2_moe", "n_experts": 4, "n_experts_per_token": 2,
                 "moe_ffn_hidden_dim": 32, "shared_expert_dim": 32}}


def batch(vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (3, 17), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, 9:] = -100
    return ids, labels


def both_paths(model, call):
    """`call(model)`'s result and its gradient on every weight, chunked then whole."""
    out = []
    for chunked in (True, False):
        model.chunked_head = chunked
        model.zero_grad()
        # the chunked path never asks for the whole logits
        with mock.patch.object(model, "compute_logits", side_effect=AssertionError) \
                if chunked else contextlib.nullcontext():
            value = call(model)
        value.sum().backward()
        out.append((value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                     if p.grad is not None}))
    model.chunked_head = True
    return out


def assert_same(chunked, whole, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(chunked[0], whole[0], rtol=rtol, atol=atol)
    assert chunked[1].keys() == whole[1].keys() and chunked[1]
    for name, grad in chunked[1].items():
        torch.testing.assert_close(grad, whole[1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
def test_the_chunked_loss_equals_the_whole_logits_loss(case, z_loss):
    model = tiny_model(n_layers=1, **CASES[case]).train()
    ids, labels = batch()
    chunked, whole = both_paths(model, lambda m: m(ids, labels=labels, return_logits=False,
                                                   z_loss=z_loss).loss)
    assert_same(chunked, whole)
    out = model(ids, labels=labels, return_logits=False, z_loss=z_loss)
    assert out.logits is None and (out.z is not None) and out.z > 0


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_label_logprobs_equal_the_log_softmax_of_the_logits(case, temperature):
    model = tiny_model(n_layers=1, **CASES[case]).train()
    ids, labels = batch()
    weights = torch.linspace(-1, 1, 16)  # any non-uniform use of the rows

    def call(m):
        return (m(ids, head_op=LabelLogprobs(labels, temperature)).head * weights).sum(-1)
    chunked, whole = both_paths(model, call)
    assert_same(chunked, whole)
    with torch.no_grad():
        logits = model(ids).logits[:, :-1] / temperature
        targets = labels[:, 1:]
        picked = -F.cross_entropy(logits.transpose(1, 2), targets.clamp(min=0),
                                  reduction="none") * (targets != -100)
        ours = model(ids, head_op=LabelLogprobs(labels, temperature)).head
    torch.testing.assert_close(ours, picked, rtol=1e-5, atol=1e-6)
    assert (ours[targets == -100] == 0).all()


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_the_distillation_loss_equals_ce_and_kd_from_the_logits(kind):
    student, teacher = tiny_model(n_layers=1).train(), tiny_model(n_layers=2)
    ids, labels = batch()
    with torch.no_grad():
        teacher_logits = teacher(ids).logits[:, :-1]
    rows = teacher_logits.flatten(0, 1)
    config = SimpleNamespace(loss=kind, temperature=2.0, jsd_beta=0.3, ce_weight=0.4)
    ops = []

    def call(m):
        ops.append(DistillationLoss(labels, lambda r: rows[r], config))
        return m(ids, labels=labels, head_op=ops[-1]).loss
    chunked, whole = both_paths(student, call)
    assert_same(chunked, whole)
    out = student(ids, labels=labels)
    kd = kd_loss(out.logits[:, :-1], teacher_logits, labels[:, 1:] != -100, kind, 2.0, 0.3)
    torch.testing.assert_close(ops[0].parts["ce"], out.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ops[0].parts["kd"], kd.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked[0], 0.4 * out.loss.detach() + 0.6 * kd.detach(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_lora_adapted_head_is_chunked_as_base_plus_its_adapter(dropout):
    """Without dropout the chunked head reads base + B·A (gradients reach A and B as through
    the whole logits); with dropout on the head's input it cannot, and makes them whole."""
    model = apply_lora(tiny_model(n_layers=1).train(), LoraSection(
        enabled=True, r=4, alpha=8.0, dropout=dropout, target_modules=["q_proj", "lm_head"]))
    assert model.chunked_head == (dropout == 0)
    if dropout:
        return
    with torch.no_grad():  # B starts at zero: make the adapter count
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    ids, labels = batch()
    chunked, whole = both_paths(model, lambda m: m(ids, labels=labels,
                                                   return_logits=False).loss)
    assert_same(chunked, whole)
    assert any("lm_head.lora_A" in name for name in chunked[1])
