"""The native element-wise layers (csrc/elementwise_cpu.cpp) give their references' values
at sizes that are and are not whole vectors or whole thread chunks, on strided inputs and at
extreme gates; refuse what they cannot read; and the dispatch sends a float32 CPU forward to
them only inside `native_inference` (the serve engine's forwards) and there only where
nothing else must see the computation: not with a gradient to record, not in bf16 (autocast
included), not under torch.compile, not with the kernel disabled."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lathe.kernels.cpu_native import native_inference
from lathe.kernels.dispatch import kernels_off
from tests.builders import tiny_model

# the package exports functions under the modules' names
rmsnorm = importlib.import_module("lathe.kernels.rmsnorm")
swiglu = importlib.import_module("lathe.kernels.swiglu")
rope = importlib.import_module("lathe.kernels.rope")

pytestmark = pytest.mark.native_cpu

NATIVE_OPS = ("lathe::rms_norm_cpu", "lathe::add_rms_norm_cpu", "lathe::swiglu_cpu",
              "lathe::rope_cpu")



def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 3, 300])
@pytest.mark.parametrize("cols", [1, 7, 128, 4099])
def test_rms_norm_matches_the_reference(rows, cols):
    x, weight = randn(rows, cols, seed=cols) * 3, randn(cols, seed=1)
    torch.testing.assert_close(rmsnorm.rms_norm_cpu(x, weight, 1e-5),
                               rmsnorm.rms_norm_reference(x, weight, 1e-5))
    residual = randn(rows, cols, seed=2)
    normed, total = rmsnorm.add_rms_norm_cpu(x, residual, weight, 1e-5)
    expected_normed, expected_total = rmsnorm.add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(total, expected_total)
    torch.testing.assert_close(normed, expected_normed)


def test_rms_norm_reads_a_strided_batch():
    x = randn(2, 64, 5, seed=3).transpose(1, 2)  # (2, 5, 64), rows not contiguous
    weight = randn(64, seed=4)
    torch.testing.assert_close(rmsnorm.rms_norm_cpu(x, weight, 1e-6),
                               rmsnorm.rms_norm_reference(x, weight, 1e-6))


@pytest.mark.parametrize("numel", [1, 17, 2 * 16384 + 5])
def test_swiglu_matches_the_reference(numel):
    gate, up = randn(numel, seed=numel) * 4, randn(numel, seed=5)
    torch.testing.assert_close(swiglu.swiglu_cpu(gate, up), swiglu.swiglu_reference(gate, up))


def test_swiglu_saturates_at_extreme_gates():
    gate = torch.tensor([-1e4, -200.0, -89.0, -87.0, -20.0, 0.0, 20.0, 87.0, 89.0, 200.0, 1e4,
                         3.0, -3.0, 0.5, -0.5, 1.0, 7.0])
    up = torch.linspace(-2, 2, gate.numel())
    out = swiglu.swiglu_cpu(gate, up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, swiglu.swiglu_reference(gate, up))


@pytest.mark.parametrize("dim", [2, 6, 32, 128])
def test_rope_matches_the_reference_on_strided_heads(dim):
    batch, seq, heads = 3, 9, 4
    q = randn(batch, seq, heads, dim, seed=dim).transpose(1, 2)  # as the model views it
    positions = torch.arange(seq, dtype=torch.float32)[None] + torch.tensor([[0.0], [4], [11]])
    angles = positions[..., None] * torch.linspace(0.05, 1.0, dim)
    cos, sin = angles.cos(), angles.sin()
    out = rope.rope_cpu(q, cos, sin)
    assert out.is_contiguous()
    torch.testing.assert_close(out, rope.rotate_reference(q, cos, sin))
    # one table row set for every sequence of the batch
    torch.testing.assert_close(rope.rope_cpu(q, cos[:1], sin[:1]),
                               rope.rotate_reference(q, cos[:1], sin[:1]))


@pytest.mark.parametrize("call, message", [
    (lambda: rmsnorm.rms_norm_cpu(torch.zeros(2, 8).double(), torch.ones(8), 1e-5), "float32"),
    (lambda: rmsnorm.rms_norm_cpu(torch.zeros(2, 8), torch.ones(7), 1e-5), "weight must be"),
    (lambda: rmsnorm.add_rms_norm_cpu(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8),
                                      1e-5), "residual must be"),
    (lambda: swiglu.swiglu_cpu(torch.zeros(4), torch.zeros(5)), "up must be"),
    (lambda: rope.rope_cpu(torch.zeros(1, 2, 3, 5), torch.zeros(1, 3, 5), torch.zeros(1, 3, 5)),
     "even D"),
    (lambda: rope.rope_cpu(torch.zeros(2, 2, 3, 4), torch.zeros(2, 4, 4), torch.zeros(2, 4, 4)),
     "cos and sin must be"),
])
def test_wrong_inputs_are_refused(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def native_ops_run(model: torch.nn.Module, ids: torch.Tensor,
                   scoped: bool = True) -> tuple[set[str], torch.Tensor]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if scoped:
            with native_inference():
                logits = model(ids).logits
        else:
            logits = model(ids).logits
    return {e.key for e in prof.key_averages()} & set(NATIVE_OPS), logits


def test_an_inference_forward_takes_every_native_op_and_matches_the_references():
    model = tiny_model().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        ran, logits = native_ops_run(model, ids)
        with kernels_off("rms_norm", "add_rms_norm", "swiglu", "rope"):
            ran_off, expected = native_ops_run(model, ids)
        ran_outside, outside = native_ops_run(model, ids, scoped=False)
    assert ran == set(NATIVE_OPS) and not ran_off and not ran_outside
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
    # a forward outside the engine's scope computes exactly what it would had the kernels
    # never been loaded: a training run's evaluations do not depend on it
    assert torch.equal(outside, expected)


def test_training_bf16_and_compiled_forwards_keep_the_references():
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator()
                        .manual_seed(1))
    ran, logits = native_ops_run(model, ids)  # grad enabled, parameters require it
    assert not ran
    logits.sum().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ran, bf16_logits = native_ops_run(model, ids)
    # autocast makes the linears' outputs bf16; the norms still read float32
    assert not ran & {"lathe::swiglu_cpu", "lathe::rope_cpu"}
    torch.testing.assert_close(bf16_logits.float(), logits.detach(), atol=0.1, rtol=0.05)
    compiled = torch.compile(model.eval(), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        ran, compiled_logits = native_ops_run(compiled, ids)
    assert not ran
    torch.testing.assert_close(compiled_logits, logits.detach(), atol=2e-5, rtol=1e-5)


def test_the_fakes_give_the_native_outputs_shapes_and_strides():
    """What a traced graph would be told of each op's output matches what it returns (a
    contiguous tensor, whatever the input's strides)."""
    x = randn(2, 8, 5, seed=6).transpose(1, 2)
    q = randn(1, 4, 3, 8, seed=7).transpose(1, 2)
    table = randn(1, 4, 8, seed=8)
    for op, args in [(torch.ops.lathe.rms_norm_cpu.default, (x, torch.ones(8), 1e-5)),
                     (torch.ops.lathe.add_rms_norm_cpu.default, (x, x.clone(), torch.ones(8),
                                                                 1e-5)),
                     (torch.ops.lathe.swiglu_cpu.default, (x, x)),
                     (torch.ops.lathe.rope_cpu.default, (q, table, table))]:
        assert torch.library.opcheck(op, args, test_utils=("test_faketensor",)) == {
            "test_faketensor": "SUCCESS"}, op
