"""The native CPU paged-decode kernel (csrc/paged_decode_cpu.cpp) against gather + SDPA:
head sizes with and without a specialized loop, GQA ratios 1 to 8, block sizes that are
and are not powers of two, tables with holes, contexts from 1 token to many blocks, fp32
and the half dtypes; through `paged_decode`'s dispatch, inside a compiled graph, in the
engine; its bounds checks; and the fallback when the build fails. Tolerance: fp32 1e-5;
fp16 and bf16 against the fp32 reference on the same inputs, 2e-3 and 1.5e-2."""

from __future__ import annotations

import warnings

import pytest
import torch

from lathe.kernels import cpu_native
from lathe.kernels.dispatch import kernels_off
from lathe.kernels.paged_attention import paged_decode, paged_decode_cpu, paged_decode_reference

pytestmark = pytest.mark.native_cpu

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
             torch.bfloat16: (1.5e-2, 1.5e-2)}



def paged_inputs(batch: int, n_heads: int, n_kv_heads: int, head_dim: int, block_size: int,
                 lens: list[int], seed: int = 0, width: int | None = None):
    """Random slabs, strided queries (as the engine hands them) and block tables whose
    blocks are scattered through the pool with unused blocks between sequences."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = 2 * sum(blocks) + 3
    k_slab = torch.randn(num_blocks * block_size, n_kv_heads, head_dim, generator=g)
    v_slab = torch.randn(num_blocks * block_size, n_kv_heads, head_dim, generator=g)
    q = torch.randn(n_heads, batch, head_dim, generator=g).transpose(0, 1)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(batch, width or max(blocks), dtype=torch.long)
    used = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = order[used:used + count]
        used += count + 1
    return q, k_slab, v_slab, tables, torch.tensor(lens)


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim", [
    (4, 2, 32), (8, 2, 64), (8, 8, 128), (8, 1, 24), (6, 3, 40)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_native_kernel_matches_gather_and_sdpa(n_heads, n_kv_heads, head_dim, block_size):
    lens = [1, block_size, block_size + 1, 7 * block_size + 3, 70]
    q, k, v, tables, lens = paged_inputs(5, n_heads, n_kv_heads, head_dim, block_size, lens)
    torch.testing.assert_close(paged_decode_cpu(q, k, v, tables, lens, block_size),
                               paged_decode_reference(q, k, v, tables, lens, block_size),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # one chunk of sums, two, a partial one
def test_native_kernel_in_half_dtypes_accumulates_in_fp32(dtype, head_dim):
    q, k, v, tables, lens = paged_inputs(3, 8, 2, head_dim, 16, [9, 40, 130], seed=1)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = paged_decode_cpu(q, k, v, tables, lens, 16)
    assert out.dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), paged_decode_reference(
        q.float(), k.float(), v.float(), tables, lens, 16), atol=atol, rtol=rtol)


def test_table_width_past_the_context_is_never_read():
    """Blocks past a row's context may be anything (a compiled step passes the full
    width): the result is that of the table cut to the context."""
    q, k, v, tables, lens = paged_inputs(2, 4, 2, 32, 8, [3, 20], width=6)
    wide = tables.clone()
    wide[:, 3:] = k.shape[0] // 8 + 1000  # outside the slabs altogether
    wide[0, 1:] = -1
    torch.testing.assert_close(paged_decode_cpu(q, k, v, wide, lens, 8),
                               paged_decode_reference(q, k, v, tables, lens, 8))


def test_dispatch_picks_the_native_kernel_unless_disabled():
    q, k, v, tables, lens = paged_inputs(4, 4, 2, 32, 16, [5, 17, 33, 64], seed=2)
    native = paged_decode_cpu(q, k, v, tables, lens, 16)
    reference = paged_decode_reference(q, k, v, tables, lens, 16)
    assert not torch.equal(native, reference)  # different sums: the two are told apart
    assert torch.equal(paged_decode(q, k, v, tables, lens, 16), native)
    with kernels_off("paged_decode"):
        assert torch.equal(paged_decode(q, k, v, tables, lens, 16), reference)
    assert torch.equal(paged_decode(q.requires_grad_(), k, v, tables, lens, 16), reference)


def test_a_compiled_graph_calls_the_native_kernel_whole():
    q, k, v, tables, lens = paged_inputs(3, 4, 2, 32, 16, [5, 40, 90], seed=3)
    compiled = torch.compile(paged_decode, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(q, k, v, tables, lens, 16),
                               paged_decode_cpu(q, k, v, tables, lens, 16))


@pytest.mark.parametrize("change, message", [
    (lambda t, n: (t.index_fill(1, torch.tensor([0]), 10_000), n), "outside the slabs"),
    (lambda t, n: (t, n + 1000), "not within its table"),
    (lambda t, n: (t, n.new_zeros(n.shape)), "not within its table"),
    (lambda t, n: (t[:1], n), "block_tables must be"),
])
def test_out_of_range_tables_and_lengths_are_refused(change, message):
    q, k, v, tables, lens = paged_inputs(2, 4, 2, 32, 16, [5, 20])
    tables, lens = change(tables, lens)
    with pytest.raises(RuntimeError, match=message):
        paged_decode_cpu(q, k, v, tables, lens, 16)


def test_heads_that_do_not_group_are_refused():
    q, k, v, tables, lens = paged_inputs(1, 4, 2, 32, 16, [5])
    with pytest.raises(RuntimeError, match="not a multiple of 3 KV heads"):
        paged_decode_cpu(q, k[:, :1].expand(-1, 3, -1).contiguous(),
                         v[:, :1].expand(-1, 3, -1).contiguous(), tables, lens, 16)


def test_a_failed_build_warns_once_and_keeps_the_reference(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(**_):
        raise RuntimeError("Error building extension 'lathe_cpu_kernels': c++ not found")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(cpu_native, "_loaded", None)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with pytest.warns(UserWarning, match="PyTorch reference"):
        assert not cpu_native.load_cpu_kernels()
    assert not cpu_native.cpu_kernels_loaded()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cpu_native.load_cpu_kernels()  # not retried, not warned again
    q, k, v, tables, lens = paged_inputs(2, 4, 2, 32, 16, [5, 20])
    assert torch.equal(paged_decode(q, k, v, tables, lens, 16),
                       paged_decode_reference(q, k, v, tables, lens, 16))
    folder = next((tmp_path / "lathe").iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["build.lock"]  # no half-built leftovers


def test_engine_greedy_tokens_match_the_gather_path():
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams
    from tests.builders import serve_model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23, 40, 61)]
    params = SamplingParams(max_tokens=24, temperature=0)
    model = serve_model(256)

    def run():
        engine = LLMEngine(model, config=EngineConfig(block_size=8, num_blocks=64))
        return [c.outputs[0].token_ids for c in engine.generate(prompts, params)]

    native = run()
    with kernels_off("paged_decode"):
        assert run() == native


def test_the_library_runs_its_loops_on_torchs_threads():
    """Built without OpenMP, `at::parallel_for` in the library would be a serial loop (it
    was, unnoticed, until the build passed -fopenmp)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_native.native_threads() == 2
        torch.set_num_threads(1)
        assert cpu_native.native_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_a_serial_build_is_warned_about(monkeypatch):
    monkeypatch.setattr(cpu_native, "native_threads", lambda: 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with pytest.warns(UserWarning, match="without OpenMP"):
        cpu_native._check_threads()
