"""int8 / int4 dequantize-matmul kernels (interpreter) against the dequantize-then-linear
references, in the serve engine's packed format. Tolerance: fp32 1e-4 relative to the
output scale (different summation order over K); fp16 and bf16 inputs 1e-2 and 2e-2."""

from __future__ import annotations

import pytest
import torch
import triton

from lathe.kernels.decode_linear import MAX_ROWS
from lathe.kernels.dispatch import kernels_off
from lathe.kernels.quant_matmul import (
    int4_matmul_cpu,
    int4_matmul_reference,
    int4_pack_for_cpu,
    int8_matmul_cpu,
    int8_matmul_reference,
)
from lathe.kernels.quant_matmul_triton import (
    _int4_matmul,
    _int8_matmul,
    all_configs,
    int4_matmul_triton,
    int8_matmul_triton,
    prune_configs,
    row_bucket,
)
from lathe.serve.quant import quantize_int4, quantize_int8
from tests.kernels.target import DEVICE, DTYPES, enable_kernels

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    scale = b.float().abs().max()
    assert ((a.float() - b.float()).abs().max() / scale).item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 96, 128), (5, 130, 64), (33, 64, 256)])
def test_int8_matmul_matches_reference(m, n, k, dtype):
    g = torch.Generator().manual_seed(0)
    q, scale = (t.to(DEVICE) for t in quantize_int8(torch.randn(n, k, generator=g)))
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    close(int8_matmul_triton(x, q, scale), int8_matmul_reference(x, q, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, group", [(1, 64, 128, 128), (7, 100, 256, 32),
                                            (20, 64, 192, 64)])
def test_int4_matmul_matches_reference(m, n, k, group, dtype):
    g = torch.Generator().manual_seed(0)
    packed, scale, minimum = (t.to(DEVICE) for t in quantize_int4(
        torch.randn(n, k, generator=g), group))
    x = torch.randn(2, m, k, generator=g).to(DEVICE, dtype)
    close(int4_matmul_triton(x, packed, scale, minimum),
          int4_matmul_reference(x, packed, scale, minimum), dtype)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_compiled_graph_calls_each_triton_gemm_as_one_op(mode):
    """Two launches of one autotuned kernel in a graph, as a decode step's projections make:
    dynamo must not trace the launch (torch 2.11 fails on the second on a GPU; under the
    interpreter any trace breaks the graph), so fullgraph compiles and equals eager."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(64, 128, generator=g) for _ in range(2)]
    if mode == "int8":
        packs = [tuple(t.to(DEVICE) for t in quantize_int8(w)) for w in weights]
        gemm = int8_matmul_triton
    else:
        packs = [tuple(t.to(DEVICE) for t in quantize_int4(w, 32)) for w in weights]
        gemm = int4_matmul_triton

    def step(x):
        return gemm(x, *packs[0]) + gemm(x, *packs[1])

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(3, 128, generator=g).to(DEVICE)
    compiled = torch.compile(step, backend=record, fullgraph=True)
    torch.testing.assert_close(compiled(x), step(x))
    ops = [node.target for graph in graphs for node in graph.graph.nodes
           if node.op == "call_function"]
    assert ops.count(getattr(torch.ops.lathe, f"{mode}_matmul_triton").default) == 2


def test_every_tile_the_autotuner_may_pick_computes_the_reference():
    """On a GPU the autotuner picks among all tiles; the interpreter runs only the first, so
    each is launched here directly, at rows that are and are not whole tiles and (int8) a K
    that is not a whole tile."""
    g = torch.Generator().manual_seed(3)
    n, group = 40, 128
    for k in (256, 200):
        q, scale = (t.to(DEVICE) for t in quantize_int8(torch.randn(n, k, generator=g)))
        packed, scale4, minimum = (t.to(DEVICE) for t in quantize_int4(
            torch.randn(n, k, generator=g), group)) if k % group == 0 else (None,) * 3
        for config in all_configs():
            meta = dict(config.kwargs, num_warps=config.num_warps,
                        num_stages=config.num_stages)
            for m in (1, 20):
                x = torch.randn(m, k, generator=g).to(DEVICE)
                grid = (triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]))
                y = torch.empty(m, n, device=DEVICE)
                _int8_matmul.fn[grid](x, q, scale, y, m, n, k, row_bucket(m), PRECISION="ieee",
                                      **meta)
                close(y, int8_matmul_reference(x, q, scale), torch.float32)
                if packed is not None and group % meta["BK"] == 0:
                    _int4_matmul.fn[grid](x, packed, scale4, minimum, y, m, n, k, group,
                                          row_bucket(m), PRECISION="ieee", **meta)
                    close(y, int4_matmul_reference(x, packed, scale4, minimum), torch.float32)


def test_tiles_are_pruned_to_the_row_bucket_and_the_int4_group():
    configs = all_configs()
    assert [row_bucket(m) for m in (1, 16, 17, 32, 33, 4096)] == [16, 16, 32, 32, 64, 64]
    for rows, group in ((16, None), (32, None), (64, None), (16, 64), (64, 32)):
        kept = prune_configs(configs, {"ROWS": rows, "GROUP": group})
        assert kept, (rows, group)
        assert all(c.kwargs["BM"] == rows if rows <= 32 else c.kwargs["BM"] >= 64
                   for c in kept)
        assert group is None or all(group % c.kwargs["BK"] == 0 for c in kept)
    # the few-row buckets tune narrow and wide K slices alike
    assert {c.kwargs["BK"] for c in prune_configs(configs, {"ROWS": 16})} >= {128, 256}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k, group", [(1, 64, 128, 128), (7, 96, 256, 32),
                                            (40, 64, 192, 64)])
def test_torchs_cpu_int8_and_int4_gemms_match_the_references(m, n, k, group, dtype):
    """The CPU path rounds activations to bf16: within 1e-2 of the output scale."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=g)
    x = torch.randn(2, m, k, generator=g).to(dtype)
    q, scale = quantize_int8(weight)
    got = int8_matmul_cpu(x, q, scale)
    assert got.dtype == dtype and got.shape == (2, m, n)
    close(got, int8_matmul_reference(x, q, scale), torch.float16)
    packed, scale, minimum = quantize_int4(weight, group)
    got = int4_matmul_cpu(x, *int4_pack_for_cpu(packed, scale, minimum))
    assert got.dtype == dtype and got.shape == (2, m, n)
    close(got, int4_matmul_reference(x, packed, scale, minimum), torch.float16)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_on_cpu_takes_torchs_gemms_and_stays_close(mode):
    """Kernels on (the default), a CPU model runs the int8/int4 GEMMs (at 18 float32 rows
    lathe's native int8 op); LATHE_KERNELS=0 gives the dequantize-then-linear reference; the
    logits agree to 2e-2 of their scale."""
    from lathe.serve.quant import quantize_linears
    from tests.builders import tiny_model
    model = tiny_model(n_layers=1)
    quantize_linears(model, mode, group_size=32)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        with kernels_off():
            off = model(ids).logits
        on = model(ids).logits
    assert not torch.equal(on, off)
    close(on, off, torch.bfloat16)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_matches_with_kernels_on(mode, monkeypatch):
    from lathe.serve.quant import quantize_linears
    from tests.builders import tiny_model
    model = tiny_model(n_layers=1)
    quantize_linears(model, mode, group_size=32)
    model.to(DEVICE)
    ids = torch.randint(0, 256, (2, 9), device=DEVICE)
    with torch.no_grad():
        with kernels_off():
            off = model(ids).logits
        enable_kernels(monkeypatch)
        on = model(ids).logits
    close(on, off, torch.float32)


def test_cpu_gemm_takes_a_misaligned_weight_without_crashing():
    """A packed weight viewed at an odd offset (as safetensors can hand one out) used to
    SIGSEGV torch's CPU int8 GEMM; it is copied to aligned memory first. At 3 rows lathe's
    native op reads it, at 40 torch's GEMM."""
    g = torch.Generator().manual_seed(0)
    q, scale = quantize_int8(torch.randn(64, 128, generator=g))
    buffer = torch.empty(q.numel() + 40, dtype=torch.int8)
    misaligned = buffer[40:].view(64, 128)
    misaligned.copy_(q)
    assert misaligned.data_ptr() % 64
    for rows in (3, 40):
        x = torch.randn(rows, 128, generator=g)
        close(int8_matmul_cpu(x, misaligned, scale), int8_matmul_reference(x, q, scale),
              torch.float16)


@pytest.mark.parametrize("k", [24, 40, 8])
@pytest.mark.parametrize("rows", [1, 4, 40])
def test_int8_cpu_matmul_of_a_width_torchs_gemm_cannot_take(rows, k):
    """torch's CPU int8 GEMM computes wrong values (or crashes) for K not a multiple of 16,
    as a narrow expert's down projection has: such a width takes the reference."""
    g = torch.Generator().manual_seed(0)
    q, scale = quantize_int8(torch.randn(64, k, generator=g))
    x = torch.randn(rows, k, generator=g)
    close(int8_matmul_cpu(x, q, scale), int8_matmul_reference(x, q, scale), torch.float16)


@pytest.mark.native_cpu
def test_native_cpu_gemm_ops_equal_the_python_ones_and_a_compiled_graph_calls_them():
    """With lathe's native CPU kernels loaded, a compiled graph calls the GEMMs as C++ ops
    (no interpreter per call): the same results as the Python ops, misaligned weight
    included; float32 rows, a prefill's too, take the native int8 op, bf16 ones torch's GEMM."""
    from lathe.kernels import quant_matmul
    from lathe.kernels.cpu_native import load_cpu_kernels
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=g)
    q, scale = quantize_int8(weight)
    buffer = torch.empty(q.numel() + 40, dtype=torch.int8)
    misaligned = buffer[40:].view(64, 128)
    misaligned.copy_(q)
    x2 = torch.randn(3, 128, generator=g).bfloat16()
    assert torch.equal(quant_matmul._int8_gemm_native(x2, misaligned, scale.bfloat16()),
                       quant_matmul._int8_gemm_op(x2, q, scale.bfloat16()))
    pack = int4_pack_for_cpu(*quantize_int4(weight, 32))
    assert torch.equal(quant_matmul._int4_gemm_native(x2, *pack),
                       quant_matmul._int4_gemm_op(x2, *pack))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for rows, dtype, int8_op in ((3, torch.float32, "decode_linear_int8_cpu"),
                                 (MAX_ROWS + 1, torch.float32, "decode_linear_int8_cpu"),
                                 (3, torch.bfloat16, "int8_matmul_cpu_native")):
        x = torch.randn(2, rows, 128, generator=g).to(dtype)
        compiled = torch.compile(lambda x: int8_matmul_cpu(x, q, scale)
                                 + int4_matmul_cpu(x, *pack), backend=record, fullgraph=True)
        torch.testing.assert_close(compiled(x), int8_matmul_cpu(x, q, scale)
                                   + int4_matmul_cpu(x, *pack))
        called = {str(node.target) for node in graphs[-1].graph.nodes
                  if node.op == "call_function"}
        assert {f"lathe.{int8_op}.default", "lathe.int4_matmul_cpu_native.default"} <= called
