"""The few-row CPU linears (csrc/decode_linear_cpu.cpp) against their references, float32,
bf16, fp16 and int8 weights, one weight or several at once, and the graph pass that routes a
compiled graph's linears to them: only float32 ones of at most MAX_ROWS rows (the rest stay
on BLAS), one call for the linears of a weight dtype that read the same x. Tolerance 1e-5
relative (the sums are reordered)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lathe.kernels.decode_linear import (
    MAX_ROWS,
    DecodeLinear,
    decode_linear_cpu,
    decode_linear_int8_cpu,
    decode_linear_reference,
)
from lathe.kernels.decode_linear_pass import DecodeLinearPass
from lathe.kernels.quant_matmul import int8_matmul_cpu, int8_matmul_reference
from lathe.serve.quant import quantize_int8

pytestmark = pytest.mark.native_cpu



@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17])
@pytest.mark.parametrize("out_features, in_features", [(64, 128), (4099, 128), (130, 256),
                                                       (7, 352), (33, 24)])
def test_matches_f_linear(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    torch.testing.assert_close(decode_linear_cpu(x, [weight]),
                               decode_linear_reference(x, [weight]), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_a_group_of_weights_is_each_weights_linear(rows):
    """q/k/v-like and gate/up-like groups, and sizes whose features split across the threads
    inside a weight, on a boundary between two, and not at all."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=g)
    for sizes in ([128, 64, 64], [352, 352], [3, 4099, 70]):
        weights = [torch.randn(size, 128, generator=g) for size in sizes]
        out = decode_linear_cpu(x, weights)
        assert [tuple(y.shape) for y in out] == [(rows, size) for size in sizes]
        torch.testing.assert_close(out, decode_linear_reference(x, weights), atol=1e-4,
                                   rtol=1e-5)


def test_strided_inputs_are_read_as_their_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 3, generator=g).t()  # (3, 128), column-major
    weights = [torch.randn(128, 96, generator=g).t(), torch.randn(10, 128, generator=g)]
    torch.testing.assert_close(decode_linear_cpu(x, weights),
                               decode_linear_reference(x, weights), atol=1e-4, rtol=1e-5)


def rounds_x_to_bf16() -> bool:
    """Whether this CPU multiplies bf16 weights by x rounded to bf16 (AVX-512 BF16's dot
    products) rather than widening the weights."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512_bf16" in flags


def half_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x · wᵀ as the native op defines it, in float64."""
    if weight.dtype == torch.bfloat16 and rounds_x_to_bf16():
        x = x.bfloat16()
    return torch.nn.functional.linear(x.double(), weight.double()).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 32, 77])
@pytest.mark.parametrize("sizes, in_features", [([64], 128), ([4099], 768), ([130, 7], 256),
                                                ([128, 64, 64], 128), ([7], 352),
                                                ([33, 5, 2], 24), ([9], 40)])
def test_half_weights_match_the_widened_reference(dtype, rows, sizes, in_features):
    """Tiles of four rows and every remainder, feature counts that are not multiples of four,
    in_features that are not whole vectors (24, 40, 352: neither 16 nor 32 wide); on a CPU
    with AMX, bf16 weights at 17 rows and more go through its tiles (blocks of 32 features
    and 32 rows: 4099 and 130 features and 17 and 77 rows leave partial ones)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    weights = [torch.randn(size, in_features, generator=g).to(dtype) for size in sizes]
    out = decode_linear_cpu(x, weights)
    assert [(y.dtype, tuple(y.shape)) for y in out] == [(torch.float32, (rows, size))
                                                         for size in sizes]
    torch.testing.assert_close(out, [half_reference(x, w) for w in weights], atol=1e-4,
                               rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weights_give_a_row_the_same_numbers_at_any_row_count(dtype):
    """A prefill's rows and a decode step's one row meet the same weights in the same
    products (AMX tiles from 16 rows where the CPU has them, AVX-512 dot products below):
    only the order of the float32 sums may differ."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 768, generator=g)
    weights = [torch.randn(size, 768, generator=g).to(dtype) for size in (2048, 96)]
    together = decode_linear_cpu(x, weights)
    alone = [torch.cat(parts) for parts in zip(*(decode_linear_cpu(x[i:i + 1], weights)
                                                 for i in range(len(x))), strict=True)]
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-5)


def test_bf16_weights_lose_only_what_rounding_x_loses():
    """Against the exact product, the error is x's bf16 rounding (2^-9 relative a value) and
    no more: well below what rounding the weights to bf16 cost in the first place."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, 768, generator=g), torch.randn(512, 768, generator=g)
    exact = torch.nn.functional.linear(x.double(), weight.double())
    ours = decode_linear_cpu(x, [weight.bfloat16()])[0].double()
    weight_rounding = (torch.nn.functional.linear(x.double(), weight.bfloat16().double())
                       - exact).abs().max()
    assert (ours - exact).abs().max() < 2 * weight_rounding


def int8_weights(sizes, in_features, g):
    return [quantize_int8(torch.randn(size, in_features, generator=g)) for size in sizes]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 32])
@pytest.mark.parametrize("sizes, in_features", [([64], 128), ([4099], 128), ([130, 7], 256),
                                                ([128, 64, 64], 128), ([352, 352], 128),
                                                ([7], 352), ([33, 5, 2], 24)])
def test_int8_weights_match_the_dequantized_reference(rows, sizes, in_features):
    """Row counts in whole tiles of four and every remainder, feature counts that are not
    multiples of four, in_features that are not whole vectors."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    weights = int8_weights(sizes, in_features, g)
    out = decode_linear_int8_cpu(x, weights)
    assert [tuple(y.shape) for y in out] == [(rows, size) for size in sizes]
    torch.testing.assert_close(out, [int8_matmul_reference(x, q, s) for q, s in weights],
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("weights, message", [
    ([(torch.zeros(4, 8), torch.ones(4))], "int8 weights"),
    ([(torch.zeros(4, 8, dtype=torch.int8), torch.ones(5))], r"scale must be float32 \(out"),
    ([(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, dtype=torch.float64))], "float32"),
    ([(torch.zeros(4, 9, dtype=torch.int8), torch.ones(4))], "must be"),
])
def test_int8_operands_of_the_wrong_kind_are_refused(weights, message):
    with pytest.raises(RuntimeError, match=message):
        decode_linear_int8_cpu(torch.zeros(2, 8), weights)
    with pytest.raises(ValueError, match="1 to 3 weights"):
        decode_linear_int8_cpu(torch.zeros(2, 8), weights * 4)


@pytest.mark.parametrize("x, weights, message", [
    (torch.zeros(2, 8), [torch.zeros(4, 9)], "must be"),
    (torch.zeros(2, 8), [torch.zeros(4, 8), torch.zeros(3, 7)], "must be"),
    (torch.zeros(2, 8, dtype=torch.float64), [torch.zeros(4, 8)], "float32"),
    (torch.zeros(2, 8), [torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float64)], "float32"),
    (torch.zeros(2, 8), [torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16)],
     "all of one dtype; got BFloat16 after Float"),
    (torch.zeros(2, 8), [torch.zeros(4, 8, dtype=torch.int8)], "float16 weights"),
])
def test_wrong_shapes_and_dtypes_are_refused(x, weights, message):
    with pytest.raises(RuntimeError, match=message):
        decode_linear_cpu(x, weights)


@pytest.mark.parametrize("count", [0, 4])
def test_a_group_takes_one_to_three_weights(count):
    with pytest.raises(ValueError, match="1 to 3 weights"):
        decode_linear_cpu(torch.zeros(2, 8), [torch.zeros(4, 8)] * count)


def called_ops(fn, *args) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    return {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("rows, dtype, rewritten", [
    (1, torch.float32, True), (MAX_ROWS, torch.float32, True),
    (MAX_ROWS + 1, torch.float32, False), (1, torch.bfloat16, False)])
def test_the_pass_moves_only_few_row_float32_linears(rows, dtype, rewritten):
    """A compiled two-layer MLP with the pass: its linears call the native op exactly when
    x has at most MAX_ROWS float32 rows, and the result is `F.linear`'s either way."""
    g = torch.Generator().manual_seed(0)
    up = torch.randn(96, 64, generator=g).to(dtype)
    down = torch.randn(64, 96, generator=g).to(dtype)

    def mlp(x):
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, up)), down)

    x = torch.randn(1, rows, 64, generator=g).to(dtype)
    compiled = torch.compile(mlp, fullgraph=True, dynamic=False,
                             options={"post_grad_custom_post_pass": DecodeLinearPass()})
    atol = 1e-4 if dtype == torch.float32 else 1e-1
    torch.testing.assert_close(compiled(x), mlp(x), atol=atol, rtol=1e-2)
    assert ("lathe::decode_linear_cpu" in called_ops(compiled, x)) == rewritten


def lathe_calls_of_compiled(fn, x: torch.Tensor) -> dict[str, int]:
    """`fn` compiled with the pass under the C++ wrapper: checked against eager on `x`,
    then how many times one call ran each lathe op."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=False,
                             options={"post_grad_custom_post_pass": DecodeLinearPass(),
                                      "cpp_wrapper": True})
    torch.testing.assert_close(compiled(x), fn(x), atol=1e-4, rtol=1e-5)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled(x)
    return {event.key: event.count for event in prof.key_averages()
            if event.key.startswith("lathe::")}


def test_the_pass_makes_one_call_for_linears_that_share_their_input():
    """q, k and v read the same x: one call (C++ from the C++ wrapper, not through Python);
    the output projection reads their concatenation: a second."""
    g = torch.Generator().manual_seed(0)
    wq, wk, wv = (torch.randn(size, 64, generator=g) for size in (64, 32, 32))
    wo = torch.randn(64, 96, generator=g)
    F = torch.nn.functional

    def block(x):
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        return F.linear(torch.cat([q, k + v], dim=-1), wo)

    calls = lathe_calls_of_compiled(block, torch.randn(1, 3, 64, generator=g))
    assert calls == {"lathe::decode_linear3_cpu": 1, "lathe::decode_linear_cpu": 1}


def test_more_linears_on_one_input_than_a_call_takes_split_into_calls():
    """A Gated DeltaNet's four input projections (qkv, z, b, a) read one x: a call of three
    and one of one, each output the linear's own."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(size, 64, generator=g) for size in (96, 48, 4, 4)]
    F = torch.nn.functional

    def projections(x):
        qkv, z, b, a = (F.linear(x, w) for w in weights)
        return torch.cat([qkv, z * 2, b.sigmoid(), a.exp()], dim=-1)

    calls = lathe_calls_of_compiled(projections, torch.randn(1, 2, 64, generator=g))
    assert calls == {"lathe::decode_linear3_cpu": 1, "lathe::decode_linear_cpu": 1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_pass_makes_one_call_for_half_linears_that_share_their_input(dtype):
    """A float32 model's half linears trace to the native op (`linear`); q, k and v become
    one call under the C++ wrapper, and no graph widens a weight."""
    from lathe.kernels.decode_linear import linear

    g = torch.Generator().manual_seed(0)
    wq, wk, wv = (torch.randn(size, 64, generator=g).to(dtype) for size in (64, 32, 32))
    wo = torch.randn(64, 96, generator=g).to(dtype)

    def block(x):
        q, k, v = linear(x, wq), linear(x, wk), linear(x, wv)
        return linear(torch.cat([q, k + v], dim=-1), wo)

    with torch.no_grad():
        calls = lathe_calls_of_compiled(block, torch.randn(1, 3, 64, generator=g))
    assert calls == {"lathe::decode_linear3_cpu": 1, "lathe::decode_linear_cpu": 1}


def test_the_pass_makes_one_call_for_int8_linears_that_share_their_input():
    """A quantized model's few-row float32 linears trace to the native int8 op; q, k and v
    become one call, and gate and up another, under the C++ wrapper."""
    g = torch.Generator().manual_seed(0)
    q, k, v = int8_weights((64, 32, 32), 64, g)
    (o,) = int8_weights((64,), 96, g)
    gate, up = int8_weights((96, 96), 64, g)

    def block(x):
        attn = torch.cat([int8_matmul_cpu(x, *q), int8_matmul_cpu(x, *k)
                          + int8_matmul_cpu(x, *v)], dim=-1)
        h = int8_matmul_cpu(attn, *o)
        return int8_matmul_cpu(h, *gate) * int8_matmul_cpu(h, *up)

    calls = lathe_calls_of_compiled(block, torch.randn(1, 3, 64, generator=g))
    assert calls == {"lathe::decode_linear_int8_3_cpu": 1, "lathe::decode_linear_int8_cpu": 1,
                     "lathe::decode_linear_int8_2_cpu": 1}


@pytest.fixture
def native_calls(monkeypatch):
    """How many times `linear` took the native op."""
    import lathe.kernels.decode_linear as module

    calls = []
    real = module.decode_linear_cpu

    def counted(x, weights):
        calls.append(tuple(x.shape))
        return real(x, weights)

    monkeypatch.setattr(module, "decode_linear_cpu", counted)
    return calls


@pytest.mark.parametrize("shape", [(1, 128), (5, 128), (MAX_ROWS, 128), (1, 3, 128),
                                   (MAX_ROWS + 1, 128), (2, 40, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_decode_linear_takes_the_native_op_for_a_few_rows_at_inference(shape, bias,
                                                                       native_calls):
    from lathe.kernels.decode_linear import DecodeLinear

    torch.manual_seed(0)
    layer = DecodeLinear(128, 96, bias=bias)
    x = torch.randn(*shape)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)
    rows = x.numel() // 128
    assert native_calls == ([(rows, 128)] if rows <= MAX_ROWS else [])
    native_calls.clear()
    y = layer(x)  # autograd on: F.linear, whose backward exists
    y.sum().backward()
    assert native_calls == [] and layer.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 5, MAX_ROWS + 1, 80])
def test_a_half_linear_of_float32_rows_takes_the_native_op_at_any_row_count(dtype, rows,
                                                                            native_calls):
    """A prefill's rows as a decode step's: float32 out, the float32 bias added; with
    autograd on, `F.linear` on the widened weight."""
    torch.manual_seed(rows)
    layer = DecodeLinear(768, 96, bias=True)
    layer.weight.data = layer.weight.data.to(dtype)
    x = torch.randn(rows, 768)
    with torch.no_grad():
        y = layer(x)
    assert native_calls == [(rows, 768)] and y.dtype == torch.float32
    torch.testing.assert_close(y, half_reference(x, layer.weight) + layer.bias, atol=1e-4,
                               rtol=1e-5)
    native_calls.clear()
    layer(x).sum().backward()
    assert native_calls == [] and layer.bias.grad is not None


def test_use_decode_linears_keeps_parameters_and_spares_other_modules():
    from lathe.kernels.decode_linear import DecodeLinear, use_decode_linears

    class Wrapped(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Wrapped(8, 8), torch.nn.LayerNorm(8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_decode_linears(model) == 1
    assert [type(m) for m in model] == [DecodeLinear, Wrapped, torch.nn.LayerNorm]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert set(before) == set(model.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bound_linear_calls_the_op_where_the_layer_would(dtype):
    """`bound_linear` (a compiled step's LM head) gives the layer's own outputs: the native
    op for float32 rows at inference (up to MAX_ROWS of a float32 weight, any number of a
    half one), the layer itself for more rows, under autograd, and for a weight it binds
    after being handed a new one; a biased layer or a plain nn.Linear is returned as is."""
    from lathe.kernels.decode_linear import bound_linear

    torch.manual_seed(0)
    layer = DecodeLinear(64, 48, bias=False)
    layer.weight.data = layer.weight.data.to(dtype)
    forward = bound_linear(layer)
    assert forward is not layer
    for rows in (1, 7, MAX_ROWS, MAX_ROWS + 9):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            torch.testing.assert_close(forward(x), layer(x), atol=1e-5, rtol=1e-5)
    x = torch.randn(3, 64, requires_grad=True)
    forward(x).sum().backward()
    assert x.grad is not None
    layer.weight = torch.nn.Parameter(torch.randn(48, 64).to(dtype))  # a reloaded head
    with torch.no_grad():
        torch.testing.assert_close(forward(x), layer(x), atol=1e-5, rtol=1e-5)
    biased, plain = DecodeLinear(64, 48), torch.nn.Linear(64, 48, bias=False)
    assert bound_linear(biased) is biased and bound_linear(plain) is plain
