"""The kernels benchmark compares like with like: at tiny sizes on CPU (Triton under the
interpreter), every implementation in every case computes the same outputs, and the
cases with a backward run it. Without a GPU it times the native CPU kernels against
their references."""

from __future__ import annotations

import pytest
import torch

from lathe.kernels import bench
from tests.kernels.target import DEVICE

TINY = bench.Sizes(rows=6, dim=64, hidden=96, vocab=300, ce_rows=10, batch=1, seq=20, heads=4,
                   kv_heads=2, head_dim=16, decode_batch=3, context=40, long_context=100,
                   block_size=16, int4_group=32)


def test_every_implementation_in_a_case_computes_the_same():
    torch.manual_seed(0)
    for case in bench.cases(TINY, device=DEVICE, dtype=torch.float32, compile=False):
        assert case.work > 0 and case.unit in ("GB/s", "TFLOP/s")
        assert {"triton"} < set(case.impls), case.name
        results = {name: bench._outputs(fn()) for name, fn in case.impls.items()}
        expected = results.pop("triton")
        for name, outs in results.items():
            for ours, theirs in zip(expected, outs, strict=True):
                scale = theirs.abs().max().clamp(min=1)
                torch.testing.assert_close(ours / scale, theirs / scale, atol=1e-4, rtol=0,
                                           msg=lambda m, c=case.name, n=name: f"{c} / {n}: {m}")
        if case.backward:
            bench._step(case.impls["triton"], backward=True)()


def test_only_picks_the_cases_whose_name_holds_one_of_its_words():
    picked = bench.cases(TINY, device=DEVICE, dtype=torch.float32, compile=False,
                         only=["attention", "paged"])
    assert [case.name for case in picked] == [
        "causal_attention", "causal_attention, packed documents", "paged_decode",
        "paged_decode, one long sequence"]
    assert len(bench.cases(TINY, device=DEVICE, dtype=torch.float32, compile=False)) > 4


def test_on_cpu_the_native_kernels_are_timed_against_their_references():
    from lathe.kernels.cpu_native import load_cpu_kernels
    if not load_cpu_kernels():
        pytest.skip("the native CPU kernels need a C++ compiler")
    torch.manual_seed(0)
    shapes = [bench.PagedShape(2, 4, 2, 16, 40), bench.PagedShape(1, 8, 2, 32, 70)]
    cases = bench.cpu_paged_cases(shapes, compile=False)
    for case in cases:
        results = {name: fn() for name, fn in case.impls.items()}
        torch.testing.assert_close(results["native C++"], results["torch (gather + SDPA)"],
                                   atol=1e-5, rtol=1e-5)
    linears = bench.cpu_linear_cases([(2, 64, 40)])
    results = {name: fn() for name, fn in linears[0].impls.items()}
    torch.testing.assert_close(results["native C++"], results["torch (F.linear, BLAS)"],
                               atol=1e-4, rtol=1e-5)
    half = bench.cpu_bf16_linear_cases([(20, 64, 40)])  # AMX's rows, where the CPU has it
    results = {name: fn() for name, fn in half[0].impls.items()}
    for other in ("torch (oneDNN bf16 GEMM)", "torch (float32 BLAS)"):
        torch.testing.assert_close(results["native C++"], results[other], atol=0.05, rtol=0.02)
    picks = bench.cpu_argmax_cases([(3, 100)])
    results = {name: fn() for name, fn in picks[0].impls.items()}
    assert torch.equal(results["native C++"], results["torch.argmax"])
    adapters = bench.cpu_lora_cases([(2, 2, 24, 40), (5, 2, 24, 40)], compile=False)
    for case in adapters:
        results = {name: fn() for name, fn in case.impls.items()}
        torch.testing.assert_close(results["native C++"], results["torch (eager)"])
    layers = bench.cpu_elementwise_cases([bench.PrefillShape(5, 16, 24, 4, 2, 8)],
                                         compile=False)
    for case in layers:
        results = {name: bench._outputs(fn()) for name, fn in case.impls.items()}
        for got, expected in zip(results["native C++"], results["torch (eager)"], strict=True):
            torch.testing.assert_close(got, expected)
    table = bench.run_cpu(cases + linears + half + picks + adapters + layers, out=None)
    rows = [line for line in table.splitlines()
            if line.startswith(("| paged_decode", "| decode_linear", "| argmax", "| lora_bgmv",
                                "| rms_norm", "| add_rms_norm", "| swiglu", "| rope"))]
    assert len(rows) == 23 and all(float(row.split("|")[3].replace(",", "")) > 0
                                   for row in rows)
