"""Paged decode attention (interpreter) against gather + SDPA: block tables with holes
(non-contiguous, unused blocks between), contexts from 1 token to several blocks, GQA
ratios 1, 4 and 8, a head size that is not a power of two, and split-KV with partitions
of one and two blocks (so short sequences have empty partitions to merge). Tolerance:
fp32 1e-5; fp16 slabs and queries 2e-3; bf16 1.5e-2 abs / 1e-2 rel (vLLM's bound)."""

from __future__ import annotations

import pytest
import torch

from lathe.kernels.dispatch import kernels_off
from lathe.kernels.paged_attention import OPAQUE_FROM_ROWS, paged_decode, paged_decode_reference
from lathe.kernels.paged_attention_triton import num_partitions, paged_decode_triton
from tests.kernels.target import DEVICE, DTYPES, enable_kernels

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
             torch.bfloat16: (1.5e-2, 1e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim", [(4, 4, 32), (4, 2, 24), (8, 2, 32),
                                                           (8, 1, 32)])
@pytest.mark.parametrize("partition_size", [512, 32, 16])
def test_paged_decode_matches_gather_and_sdpa(n_heads, n_kv_heads, head_dim, partition_size,
                                              dtype):
    atol, rtol = TOLERANCE[dtype]
    g = torch.Generator().manual_seed(0)
    block_size, num_blocks = 16, 40
    k_slab = torch.randn(num_blocks * block_size, n_kv_heads, head_dim, generator=g)
    v_slab = torch.randn(num_blocks * block_size, n_kv_heads, head_dim, generator=g)
    k_slab, v_slab = k_slab.to(DEVICE, dtype), v_slab.to(DEVICE, dtype)
    lens = torch.tensor([1, 16, 17, 70])
    order = torch.randperm(num_blocks, generator=g)  # holes: blocks scattered in the pool
    tables = torch.zeros(4, 6, dtype=torch.long)
    used = 0
    for b, n in enumerate(lens.tolist()):
        count = (n + block_size - 1) // block_size
        tables[b, :count] = order[used:used + count]
        used += count + 1  # skip one block between sequences
    q = torch.randn(n_heads, 4, head_dim, generator=g).to(DEVICE, dtype).transpose(0, 1)
    tables, lens = tables.to(DEVICE), lens.to(DEVICE)  # q is strided, as the engine hands it
    ours = paged_decode_triton(q, k_slab, v_slab, tables, lens, block_size, partition_size)
    ref = paged_decode_reference(q.float(), k_slab.float(), v_slab.float(), tables, lens,
                                 block_size)
    torch.testing.assert_close(ours.float(), ref, atol=atol, rtol=rtol)


def test_split_kv_follows_the_context_length_and_the_batch_size():
    assert num_partitions(batch=1, n_heads=32, max_context=512, partition_size=512) == 1
    assert num_partitions(batch=1, n_heads=32, max_context=4000, partition_size=512) == 8
    assert num_partitions(batch=64, n_heads=32, max_context=4000, partition_size=512) == 1
    assert num_partitions(batch=64, n_heads=32, max_context=16384, partition_size=512) == 32
    with pytest.raises(ValueError, match="multiple of block_size"):
        paged_decode_triton(torch.zeros(1, 4, 16), torch.zeros(16, 4, 16),
                            torch.zeros(16, 4, 16), torch.zeros(1, 1, dtype=torch.long),
                            torch.ones(1, dtype=torch.long), 16, partition_size=40)


def test_engine_greedy_output_is_the_same_with_the_paged_kernel(monkeypatch):
    from lathe.serve.config import EngineConfig
    from lathe.serve.engine import LLMEngine
    from lathe.serve.sampling_params import SamplingParams
    from tests.builders import serve_model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23, 40)]
    params = SamplingParams(max_tokens=10, temperature=0)

    def run():
        engine = LLMEngine(serve_model(256).to(DEVICE),
                           config=EngineConfig(block_size=16, num_blocks=64))
        return [c.outputs[0].token_ids for c in engine.generate(prompts, params)]

    with kernels_off():
        expected = run()
    enable_kernels(monkeypatch)
    assert run() == expected


def test_gqa_paged_reference_traces_whole_under_dynamic_shapes():
    torch.manual_seed(0)
    q, k_slab, v_slab = torch.randn(2, 4, 8), torch.randn(32, 2, 8), torch.randn(32, 2, 8)
    tables, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([5, 12])
    traced = torch.compile(paged_decode_reference, backend="eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(traced(q, k_slab, v_slab, tables, lens, 8),
                               paged_decode_reference(q, k_slab, v_slab, tables, lens, 8))


def test_a_compiled_step_calls_the_gather_path_whole_from_sixteen_rows():
    """Below OPAQUE_FROM_ROWS rows inductor traces the gather + SDPA; from it the graph
    holds one `lathe::paged_decode_reference` op, whose result is the reference's."""
    g = torch.Generator().manual_seed(0)
    k_slab, v_slab = torch.randn(64, 2, 8, generator=g), torch.randn(64, 2, 8, generator=g)
    for rows in (OPAQUE_FROM_ROWS // 2, OPAQUE_FROM_ROWS):
        q = torch.randn(rows, 4, 8, generator=g)
        tables = torch.randint(0, 8, (rows, 3), generator=g)
        lens = torch.randint(1, 25, (rows,), generator=g)
        graphs = []

        def record(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        with kernels_off("paged_decode"):
            compiled = torch.compile(paged_decode, backend=record, fullgraph=True)
            got = compiled(q, k_slab, v_slab, tables, lens, 8)
        torch.testing.assert_close(got, paged_decode_reference(q, k_slab, v_slab, tables,
                                                               lens, 8))
        called = {str(node.target) for node in graphs[0].graph.nodes
                  if node.op == "call_function"}
        assert ("lathe.paged_decode_reference.default" in called) == (rows >= OPAQUE_FROM_ROWS)
