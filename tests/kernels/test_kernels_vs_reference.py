"""RMSNorm (plain and fused with the residual add), SwiGLU and RoPE: Triton, run by the
interpreter on CPU, against the PyTorch references — forward and gradients, fp32 and fp16,
ordinary and awkward shapes (compiled on a GPU, bf16 too: see target.py). Tolerances:
fp32 1e-5 (abs and rel); fp16 2e-3 forward, 1e-2 gradients (gradients sum over rows in a
different order); bf16 2e-2 forward, 5e-2 gradients (Liger's bf16 bounds)."""

from __future__ import annotations

import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.kernels.dispatch import kernels_off
from lathe.kernels.rmsnorm import add_rms_norm_reference, rms_norm, rms_norm_reference
from lathe.kernels.rmsnorm_triton import add_rms_norm_triton, rms_norm_triton
from lathe.kernels.swiglu import swiglu_reference
from lathe.kernels.swiglu_triton import swiglu_triton
from tests.kernels.target import DEVICE, DTYPES, enable_kernels

SHAPES = [(2, 5, 64), (1, 96), (37, 200), (3, 130)]  # non-power-of-two widths, a single row
TOLERANCE = {torch.float32: (1e-5, 1e-5, 1e-5), torch.float16: (2e-3, 2e-3, 1e-2),
             torch.bfloat16: (2e-2, 2e-2, 5e-2)}


def inputs(shape, dtype, *extra, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(DEVICE, dtype).requires_grad_()
            for _ in range(1 + len(extra))]


def grads(out, tensors, seed=1):
    g = torch.Generator().manual_seed(seed)
    outs = out if isinstance(out, tuple) else (out,)
    upstream = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outs]
    return torch.autograd.grad(outs, tensors, upstream)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape, dtype):
    atol, rtol, grad_tol = TOLERANCE[dtype]
    (x,) = inputs(shape, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1])).to(DEVICE, dtype).requires_grad_()
    ours, ref = rms_norm_triton(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5)
    torch.testing.assert_close(ours, ref, atol=atol, rtol=rtol)
    for a, b in zip(grads(ours, [x, weight]), grads(ref, [x, weight]), strict=True):
        torch.testing.assert_close(a, b, atol=grad_tol, rtol=grad_tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm_matches_reference(shape, dtype):
    atol, rtol, grad_tol = TOLERANCE[dtype]
    x, residual = inputs(shape, dtype, "residual")
    weight = (1 + 0.1 * torch.randn(shape[-1])).to(DEVICE, dtype).requires_grad_()
    ours = add_rms_norm_triton(x, residual, weight, 1e-6)
    ref = add_rms_norm_reference(x, residual, weight, 1e-6)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    for a, b in zip(grads(ours, [x, residual, weight]), grads(ref, [x, residual, weight]),
                    strict=True):
        torch.testing.assert_close(a, b, atol=grad_tol, rtol=grad_tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 344), (1, 1), (5, 1000)])
def test_swiglu_matches_reference(shape, dtype):
    atol, rtol, grad_tol = TOLERANCE[dtype]
    gate, up = inputs(shape, dtype, "up")
    ours, ref = swiglu_triton(gate, up), swiglu_reference(gate, up)
    torch.testing.assert_close(ours, ref, atol=atol, rtol=rtol)
    for a, b in zip(grads(ours, [gate, up]), grads(ref, [gate, up]), strict=True):
        torch.testing.assert_close(a, b, atol=grad_tol, rtol=grad_tol)


def test_dispatch_picks_the_reference_off_gpu_and_honours_switches(monkeypatch):
    from lathe.kernels.dispatch import configure, kernel_enabled, use_triton
    for name in ("LATHE_KERNELS", "LATHE_KERNELS_DISABLE", "LATHE_KERNELS_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    configure()
    x, weight = torch.randn(4, 32), torch.ones(32)
    assert torch.equal(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    assert not use_triton("rms_norm", x)
    # the measured defaults: on CUDA rms_norm wins, rope and fused CE lose to torch.compile
    assert kernel_enabled("rms_norm") and kernel_enabled("paged_decode")
    assert not kernel_enabled("rope") and not kernel_enabled("linear_cross_entropy")
    assert kernel_enabled("rope", "cpu") and not kernel_enabled("linear_cross_entropy", "cpu")
    monkeypatch.setenv("LATHE_KERNELS", "force")
    assert not use_triton("rms_norm", x)  # read when a model or engine is built, not per call
    configure()
    assert use_triton("rms_norm", x) and use_triton("rope", x)
    monkeypatch.setenv("LATHE_KERNELS_DISABLE", "swiglu")
    configure()
    assert kernel_enabled("rms_norm") and not kernel_enabled("swiglu")
    monkeypatch.setenv("LATHE_KERNELS", "1")
    monkeypatch.setenv("LATHE_KERNELS_ENABLE", "rope")
    configure()
    assert kernel_enabled("rope") and kernel_enabled("rms_norm") and not kernel_enabled("swiglu")
    monkeypatch.setenv("LATHE_KERNELS", "0")
    configure()
    assert not use_triton("rms_norm", x) and not kernel_enabled("rope", "cpu")
    with pytest.raises(ValueError, match="unknown kernel"):
        kernel_enabled("flash")
    monkeypatch.setenv("LATHE_KERNELS_DISABLE", "flash")
    with pytest.raises(ConfigError, match="LATHE_KERNELS_DISABLE: unknown kernel.* flash"):
        configure()
    monkeypatch.setenv("LATHE_KERNELS", "on")
    with pytest.raises(ConfigError, match="LATHE_KERNELS='on' must be 1"):
        configure()


def test_kernels_off_turns_named_or_all_kernels_off_and_restores(monkeypatch):
    from lathe.kernels.dispatch import configure, kernel_enabled, kernels_off
    monkeypatch.setenv("LATHE_KERNELS_DISABLE", "paged_decode")
    monkeypatch.delenv("LATHE_KERNELS", raising=False)
    configure()
    with kernels_off("int8_matmul"):
        assert not kernel_enabled("int8_matmul") and not kernel_enabled("paged_decode")
        assert kernel_enabled("rms_norm")
        configure()  # a model built inside the block keeps it narrowed
        assert not kernel_enabled("int8_matmul")
    assert kernel_enabled("int8_matmul") and not kernel_enabled("paged_decode")
    with kernels_off():
        assert not any(kernel_enabled(n, d) for n in ("rms_norm", "swiglu")
                       for d in ("cuda", "cpu"))
    assert kernel_enabled("rms_norm")
    with pytest.raises(ValueError, match="unknown kernel"), kernels_off("flash"):
        pass


def test_the_defaults_table_names_its_measurements_and_is_read_once_per_build(monkeypatch):
    from lathe.kernels import dispatch
    from lathe.kernels.defaults import DEFAULTS
    from lathe.model import ModelConfig, Transformer
    for (name, device), entry in DEFAULTS.items():
        assert name in dispatch.KERNELS and device in dispatch.DEVICES
        assert entry.figure and entry.command.startswith(("python -m", "Int8Linear"))
        if entry.measured.startswith("not yet: "):  # on unmeasured, and saying why
            assert (name, device, entry.on) == ("grouped_matmul", "cuda", True)
            continue
        assert entry.measured[:10].count("-") == 2 and any(
            device in entry.measured for device in ("H100", "H200", "torch 2.13.0+cpu"))
    resolved = []
    real = dispatch.KernelPolicy.from_environment
    monkeypatch.setattr(dispatch.KernelPolicy, "from_environment",
                        classmethod(lambda cls, *a: resolved.append(1) or real(*a)))
    model = Transformer(ModelConfig.from_preset("tiny", vocab_size=64, n_layers=1))
    assert len(resolved) == 1
    ids = torch.randint(0, 64, (2, 8))
    model(ids, labels=ids).loss.backward()
    assert len(resolved) == 1  # the forward and backward only asked the resolved policy


def test_model_forward_and_backward_match_with_kernels_on(monkeypatch):
    from tests.builders import tiny_model
    ids = torch.randint(0, 256, (2, 24), device=DEVICE)

    def run():
        model = tiny_model(n_layers=2).to(DEVICE)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    with kernels_off():
        loss_off, grads_off = run()
    enable_kernels(monkeypatch)
    loss_on, grads_on = run()
    torch.testing.assert_close(loss_on, loss_off, atol=1e-5, rtol=1e-5)
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, heads, kv_heads, seq, dim", [(2, 4, 1, 7, 32), (1, 8, 8, 1, 64),
                                                               (3, 8, 2, 5, 48)])
def test_rope_matches_reference(batch, heads, kv_heads, seq, dim, dtype):
    from lathe.kernels.rope import rope_reference
    from lathe.kernels.rope_triton import rope_triton
    atol, rtol, grad_tol = TOLERANCE[dtype]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, dim, generator=g).to(DEVICE, dtype).requires_grad_()
    k = torch.randn(batch, kv_heads, seq, dim, generator=g).to(DEVICE, dtype).requires_grad_()
    angles = torch.randn(batch, seq, dim // 2, generator=g) * 3
    cos = torch.cat([angles.cos()] * 2, -1).to(DEVICE, dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(DEVICE, dtype)
    ours, ref = rope_triton(q, k, cos, sin), rope_reference(q, k, cos, sin)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    for a, b in zip(grads(ours, [q, k]), grads(ref, [q, k]), strict=True):
        torch.testing.assert_close(a, b, atol=grad_tol, rtol=grad_tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_turns_queries_alone_for_a_layer_sharing_anothers_keys(dtype):
    """Gemma 4's KV-sharing layers turn their queries only: k None, forward and backward."""
    from lathe.kernels.rope import rope_reference
    from lathe.kernels.rope_triton import rope_triton
    atol, rtol, grad_tol = TOLERANCE[dtype]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 32, generator=g).to(DEVICE, dtype).requires_grad_()
    angles = torch.randn(2, 5, 16, generator=g) * 3
    cos = torch.cat([angles.cos()] * 2, -1).to(DEVICE, dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(DEVICE, dtype)
    (ours, none), (ref, _) = rope_triton(q, None, cos, sin), rope_reference(q, None, cos, sin)
    assert none is None
    torch.testing.assert_close(ours, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(grads(ours, [q])[0], grads(ref, [q])[0], atol=grad_tol,
                               rtol=grad_tol)
