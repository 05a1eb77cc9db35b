"""Fused linear + cross-entropy (interpreter) against logits-then-F.cross_entropy: loss and
gradients, with ignored labels, a vocabulary that is not a power of two and several chunks.
Tolerances: fp32 1e-5 (loss) and 1e-5 abs / 1e-4 rel (gradients); fp16 and bf16 (the
logits rounded like the reference's, then fp32) 1e-3 / 2e-2 loss, 1e-2 / 5e-2 gradients."""

from __future__ import annotations

import pytest
import torch

from lathe.kernels.dispatch import kernels_off
from lathe.kernels.fused_ce import linear_cross_entropy_reference
from lathe.kernels.fused_ce_triton import linear_cross_entropy_triton
from tests.kernels.target import DEVICE, DTYPES, enable_kernels

TOLERANCE = {torch.float32: (1e-5, 1e-5, 1e-4), torch.float16: (1e-3, 1e-2, 1e-2),
             torch.bfloat16: (2e-2, 5e-2, 5e-2)}  # loss, gradient abs, gradient rel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, dim, vocab, chunk", [(37, 32, 300, 16), (8, 64, 5000, 8),
                                                  (1, 16, 7, 4)])
def test_fused_linear_cross_entropy_matches_reference(n, dim, vocab, chunk, dtype):
    loss_tol, grad_atol, grad_rtol = TOLERANCE[dtype]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, dim, generator=g).to(DEVICE, dtype).requires_grad_()
    weight = (0.1 * torch.randn(vocab, dim, generator=g)).to(DEVICE, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::3] = -100
    labels[0] = 1  # at least one valid label
    labels = labels.to(DEVICE)
    ours = linear_cross_entropy_triton(hidden, weight, labels, chunk=chunk)
    ref = linear_cross_entropy_reference(hidden, weight, labels)
    torch.testing.assert_close(ours, ref, atol=loss_tol, rtol=loss_tol)
    for a, b in zip(torch.autograd.grad(2.0 * ours, [hidden, weight]),
                    torch.autograd.grad(2.0 * ref, [hidden, weight]), strict=True):
        torch.testing.assert_close(a, b, atol=grad_atol, rtol=grad_rtol)


def test_model_loss_without_logits_matches_with_kernels_on_and_off(monkeypatch):
    from tests.builders import tiny_model
    model = tiny_model(n_layers=1).to(DEVICE)
    ids = torch.randint(0, 256, (2, 12), device=DEVICE)
    labels = ids.clone()
    labels[:, :4] = -100
    with kernels_off():
        plain = model(ids, labels=labels)
        assert model(ids, labels=labels, return_logits=False).logits is None
        torch.testing.assert_close(model(ids, labels=labels, return_logits=False).loss,
                                   plain.loss)
    enable_kernels(monkeypatch)
    fused = model(ids, labels=labels, return_logits=False).loss
    torch.testing.assert_close(fused, plain.loss, atol=1e-5, rtol=1e-5)
    grad_fused = torch.autograd.grad(fused, model.model.embed_tokens.weight)[0]
    grad_plain = torch.autograd.grad(plain.loss, model.model.embed_tokens.weight)[0]
    torch.testing.assert_close(grad_fused, grad_plain, atol=1e-5, rtol=1e-4)
