"""Compiled static-shape decode steps against the eager engine: same tokens across mixed
prefill/decode steps, padded buckets, preemption, prefix-cache hits and n > 1; weights
swapped after compiling are the ones used; CUDA graphs replay what eager computes."""

from __future__ import annotations

import pytest
import torch

from lathe.kernels.dispatch import kernels_off
from lathe.serve.decode_graph import batch_buckets, width_buckets
from lathe.serve.engine import EngineConfig, LLMEngine
from lathe.serve.quant import quantize_linears
from lathe.serve.sampling import SamplingParams
from tests.builders import serve_model
from tests.serve.test_engine import prompts


def engine_pair(model, **config) -> tuple[LLMEngine, LLMEngine]:
    base = {"block_size": 4, "num_blocks": 256, "max_num_seqs": 4, **config}
    return (LLMEngine(model, config=EngineConfig(**base)),
            LLMEngine(model, config=EngineConfig(**base, compile_decode=True)))


def test_a_paged_kernel_needs_one_graph_per_batch_size_whatever_the_context():
    """The native CPU kernel reads only each row's own blocks, so off CUDA the table is
    passed whole; the gather path would gather it all, so it gets width buckets."""
    from lathe.kernels.cpu_native import load_cpu_kernels
    with_kernel = LLMEngine(serve_model(256), config=EngineConfig(
        block_size=4, num_blocks=64, compile_decode=True)).runner
    with kernels_off("paged_decode"):
        gathering = LLMEngine(serve_model(256), config=EngineConfig(
            block_size=4, num_blocks=64, compile_decode=True)).runner
    assert gathering.graphs.widths == width_buckets(gathering.max_blocks)
    if load_cpu_kernels():
        assert with_kernel.graphs.widths == [with_kernel.max_blocks]


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(70) == [1, 2, 4, 8, 16, 32, 48, 64, 70]


def test_width_buckets_are_powers_of_two_up_to_the_full_table():
    assert width_buckets(1) == [1]
    assert width_buckets(12) == [1, 2, 4, 8, 12]
    assert width_buckets(32) == [1, 2, 4, 8, 16, 32]


@pytest.mark.slow
def test_compiled_decode_matches_eager_token_for_token():
    """One engine pair through mixed steps (a 24-token budget chunks the prefills beside
    decodes), 3- and 1-row decode steps padded to buckets 4 and 1, n > 1, a prefix-cache
    hit, then a cache small enough to preempt."""
    model = serve_model(256)
    eager, compiled = engine_pair(model, max_num_batched_tokens=24)
    batch = prompts([3, 17, 40])
    params = [SamplingParams(max_tokens=m, temperature=0, n=n)
              for m, n in ((12, 1), (20, 2), (6, 1))]
    want = [[o.token_ids for o in r.outputs] for r in eager.generate(batch, params)]
    got = [[o.token_ids for o in r.outputs] for r in compiled.generate(batch, params)]
    assert got == want
    hits = compiled.block_manager.prefix_hits
    again = compiled.generate(batch[1:2], params[1])[0]
    assert compiled.block_manager.prefix_hits > hits
    assert [o.token_ids for o in again.outputs] == want[1]
    assert compiled.runner.graphs.steps > 0 and eager.runner.graphs is None

    eager, compiled = engine_pair(model, num_blocks=12)
    batch = prompts([10, 14, 6, 12], seed=1)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    assert [r.outputs[0].token_ids for r in compiled.generate(batch, greedy)] == want
    assert compiled.scheduler.num_preemptions > 0
    assert compiled.block_manager.num_free == 12


@pytest.mark.slow
def test_sixteen_row_steps_call_the_attention_op_and_match_eager():
    """From 16 rows a compiled step calls the gather + SDPA as one op (below, inductor
    traces it): the same tokens, over contexts that cross table-width buckets."""
    model = serve_model(256)
    eager, compiled = engine_pair(model, max_num_seqs=16, num_blocks=512)
    batch = prompts([3 + 2 * i for i in range(16)], seed=2)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    assert [r.outputs[0].token_ids for r in compiled.generate(batch, greedy)] == want
    assert compiled.runner.graphs.steps >= 7


@pytest.mark.slow
def test_compiled_decode_reads_weights_loaded_after_it_compiled():
    """GRPO refreshes its engine's weights in place: the compiled step must not have baked
    the old ones in."""
    model, other = serve_model(256), serve_model(256)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=g))
    _, compiled = engine_pair(model)
    batch = prompts([5, 9])
    greedy = SamplingParams(max_tokens=8, temperature=0)
    before = [r.outputs[0].token_ids for r in compiled.generate(batch, greedy)]
    compiled.load_weights(other.state_dict())
    after = [r.outputs[0].token_ids for r in compiled.generate(batch, greedy)]
    reference, _ = engine_pair(other)
    assert after == [r.outputs[0].token_ids for r in reference.generate(batch, greedy)]
    assert after != before


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_linears_compile_into_the_decode_step(mode):
    """On CPU the int8/int4 GEMMs are ops a compiled step calls whole, on bf16 rows."""
    model = serve_model(256)
    quantize_linears(model, mode)
    eager, compiled = engine_pair(model)
    batch = prompts([6, 13, 4])
    greedy = SamplingParams(max_tokens=10, temperature=0)
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    assert [r.outputs[0].token_ids for r in compiled.generate(batch, greedy)] == want
    assert compiled.runner.graphs.steps > 0


@pytest.mark.slow
def test_compiled_decode_runs_bf16_weights_as_eager_does():
    """bf16 is the GPU default: the compiled step must take bf16 weights and a bf16 KV
    cache (no fp32 operand reaching a bf16 one) and pick eager's tokens."""
    model = serve_model(256).to(torch.bfloat16)
    eager, compiled = engine_pair(model)
    batch = prompts([5, 12, 8])
    greedy = SamplingParams(max_tokens=8, temperature=0)
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    assert [r.outputs[0].token_ids for r in compiled.generate(batch, greedy)] == want
    assert compiled.slabs.k[0].dtype == torch.bfloat16 and compiled.runner.graphs.steps > 0


@pytest.mark.slow
def test_seeded_sampling_through_compiled_steps_repeats():
    model = serve_model(256)
    _, compiled = engine_pair(model)
    batch = prompts([7, 11])
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=3)
    first = [r.outputs[0].token_ids for r in compiled.generate(batch, params)]
    assert [r.outputs[0].token_ids for r in compiled.generate(batch, params)] == first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graph_decode_matches_eager_on_gpu():
    model = serve_model(256).cuda()
    eager, graphed = engine_pair(model, max_num_seqs=8)
    batch = prompts([3, 17, 40, 9, 25])
    greedy = SamplingParams(max_tokens=24, temperature=0)
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    assert [r.outputs[0].token_ids for r in graphed.generate(batch, greedy)] == want
    assert graphed.runner.graphs.steps > 0
