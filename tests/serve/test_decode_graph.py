"""Compiled static-shape decode steps against the eager engine: same tokens across mixed
prefill/decode steps, padded buckets, preemption, prefix-cache hits and n > 1; weights
swapped after compiling are the ones used; CUDA graphs replay what eager computes."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from lathe.kernels.dispatch import kernels_off
from lathe.serve.config import EngineConfig, SpeculativeConfig, cache_root
from lathe.serve.decode_graph import batch_buckets, width_buckets
from lathe.serve.engine import LLMEngine
from lathe.serve.quant import quantize_linears
from lathe.serve.sampling_params import SamplingParams
from tests.builders import serve_model
from tests.serve.conftest import served, start_server, wait_healthy
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


def warmed(engine: LLMEngine) -> LLMEngine:
    """`engine` with every compiled decode step built, as `lathe serve` starts it."""
    reports = []
    engine.warm_up(lambda done, total: reports.append((done, total)))
    shapes = len(engine.runner.graphs.shapes)
    assert reports == [(done, shapes) for done in range(1, shapes + 1)]
    return engine


@pytest.mark.slow
def test_compiled_decode_matches_eager_token_for_token():
    """One engine pair through mixed steps (a 24-token budget chunks the prefills beside
    decodes), 3- and 1-row decode steps padded to buckets 4 and 1, n > 1, a prefix-cache
    hit, then a cache small enough to preempt, then speculative decoding: warmed up, the
    compiled engine builds no graph under any of it."""
    model = serve_model(256)
    eager, compiled = engine_pair(model, max_num_batched_tokens=24)
    warmed(compiled)
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
    assert compiled.stats()["decode_graphs_late"] == 0

    eager, compiled = engine_pair(model, num_blocks=12)
    warmed(compiled)
    batch = prompts([10, 14, 6, 12], seed=1)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    assert [r.outputs[0].token_ids for r in compiled.generate(batch, greedy)] == want
    assert compiled.scheduler.num_preemptions > 0
    assert compiled.block_manager.num_free == 12
    assert compiled.runner.graphs.late == 0

    eager, compiled = engine_pair(model, speculative=SpeculativeConfig("ngram", 3))
    warmed(compiled)
    batch = [p * 3 for p in prompts([4, 6, 5], seed=2)]  # repeats: lookup proposes
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    assert [r.outputs[0].token_ids for r in compiled.generate(batch, greedy)] == want
    assert compiled.stats()["spec_decode_num_drafts"] > 0
    assert compiled.runner.graphs.late == 0


@pytest.mark.slow
def test_prefill_chunks_run_compiled_in_calls_of_the_largest_bucket():
    """On CPU, prompts whose context is short attend token by token through the block
    table, so their prefill is a compiled step too: a 10-token prompt is three calls of
    the largest bucket's 4 rows (4 + 4 + 2), and its tokens and log-probs — every prompt
    position's and the sampled ones' — are eager's."""
    from lathe.kernels.cpu_native import load_cpu_kernels
    if not load_cpu_kernels():
        pytest.skip("the native CPU kernels did not build")
    eager, compiled = engine_pair(serve_model(256))
    warmed(compiled)
    scored = SamplingParams(max_tokens=1, temperature=0, logprobs=3, prompt_logprobs=2)
    batch = prompts([10])
    calls = compiled.runner.graphs.steps
    want, got = eager.generate(batch, scored)[0], compiled.generate(batch, scored)[0]
    assert compiled.runner.graphs.steps - calls == 3
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    pairs = list(zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True))
    pairs += list(zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True))
    assert len(pairs) == 10
    for mine, theirs in pairs:
        assert mine.token_id == theirs.token_id
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert [v for _, v in mine.top] == pytest.approx([v for _, v in theirs.top], abs=1e-4)

    # a mixed step (two prompts beside a decode) whose kept rows span the calls
    params = [SamplingParams(max_tokens=m, temperature=0) for m in (6, 3, 3)]
    batch = prompts([2, 7, 5], seed=3)
    want = [r.outputs[0].token_ids for r in eager.generate(batch, params)]
    assert [r.outputs[0].token_ids for r in compiled.generate(batch, params)] == want
    assert compiled.runner.graphs.late == 0


@pytest.mark.slow
def test_compiled_prefill_under_bf16_autocast_stays_close_to_eager():
    """A training stage's engine may run under bf16 autocast: its prefill still goes through
    the graphs (traced under autocast) and its prompt log-probs stay within bf16's error of
    the eager engine's under the same autocast."""
    from lathe.kernels.cpu_native import load_cpu_kernels
    if not load_cpu_kernels():
        pytest.skip("the native CPU kernels did not build")
    eager, compiled = engine_pair(serve_model(256))
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = eager.generate(prompts([10]), scored)[0].prompt_logprobs[1:]
        got = compiled.generate(prompts([10]), scored)[0].prompt_logprobs[1:]
    assert compiled.runner.graphs.steps >= 3  # 4 + 4 + 2 rows
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=0.1)


@pytest.mark.slow
def test_with_adapters_a_compiled_step_stays_within_one_bucket():
    """Each row's adapter slot is read from a tensor the largest bucket long: with LoRA
    slots, a prefill over it runs eager, one within it compiled."""
    from lathe.kernels.cpu_native import load_cpu_kernels
    if not load_cpu_kernels():
        pytest.skip("the native CPU kernels did not build")
    _, compiled = engine_pair(serve_model(256), max_loras=1)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    compiled.generate(prompts([10]), greedy)
    assert compiled.runner.graphs.steps == 0
    compiled.generate(prompts([3]), greedy)
    assert compiled.runner.graphs.steps == 1


@pytest.mark.slow
def test_a_second_start_loads_its_graphs_from_the_cache(tmp_path, monkeypatch, caplog):
    """Two engines on models of one shape but different weights: the second compiles
    nothing and decodes its own weights; a damaged cache file is compiled again."""
    monkeypatch.setenv("LATHE_CACHE_DIR", str(tmp_path))
    model, other = serve_model(256), serve_model(256)
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(1.5)
    first = warmed(engine_pair(model)[1])
    shapes = len(first.runner.graphs.shapes)
    assert first.runner.graphs.built == {"compiled": shapes}
    files = sorted((tmp_path / "decode-graphs").iterdir())
    assert len(files) == shapes

    eager, second = engine_pair(other)
    warmed(second)
    assert second.runner.graphs.built == {"cached": shapes}
    batch = prompts([5, 9, 3])
    greedy = SamplingParams(max_tokens=10, temperature=0)
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    assert [r.outputs[0].token_ids for r in second.generate(batch, greedy)] == want
    # steps trace as warm-up does (no grad: a graph traced with grad ran 300x slower), so
    # an engine that never warmed up finds warm-up's graphs
    lazy = engine_pair(other)[1]
    assert [r.outputs[0].token_ids for r in lazy.generate(batch, greedy)] == want
    # its prefill (17 tokens: bucket 32) and its 3-row decode steps (bucket 4)
    assert lazy.runner.graphs.built == {"cached": 2}

    files[0].write_bytes(b"not a compiled graph")
    third = warmed(engine_pair(other)[1])
    assert third.runner.graphs.built == {"cached": shapes - 1, "compiled": 1}
    assert "does not load" in caplog.text
    assert files[0].read_bytes() != b"not a compiled graph"


def test_a_cached_graph_is_keyed_by_the_thread_count_it_was_compiled_for():
    """Inductor writes the thread count into a CPU graph's parallel loops: a graph compiled
    in a 2-thread process and loaded by a 1-thread one would still run on 2."""
    graphs = engine_pair(serve_model(256))[1].runner.graphs
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = graphs._describe()
        torch.set_num_threads(2)
        assert graphs._describe() != one
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_graph_built_after_warm_up_is_counted_late(tmp_path, monkeypatch):
    monkeypatch.setenv("LATHE_CACHE_DIR", str(tmp_path))
    _, compiled = engine_pair(serve_model(256))
    compiled.generate(prompts([5]), SamplingParams(max_tokens=4, temperature=0))
    assert compiled.runner.graphs.late == 0  # not warmed up: every graph is built on use
    compiled.runner.graphs.warm = True
    compiled.generate(prompts([5, 7]), SamplingParams(max_tokens=4, temperature=0))
    assert compiled.runner.graphs.late == 1  # the 2-row bucket


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
    cache (no fp32 operand reaching a bf16 one), warmed up as a server starts it, and pick
    eager's tokens."""
    model = serve_model(256).to(torch.bfloat16)
    eager, compiled = engine_pair(model)
    warmed(compiled)
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
@pytest.mark.parametrize("shape", [{}, {"family": "qwen3_5_text", "n_layers": 4}],
                         ids=["llama", "qwen3_5"])
def test_cuda_graph_decode_matches_eager_on_gpu(shape):
    """Replayed CUDA graphs compute eager's tokens — with a Gated DeltaNet's states read and
    written by row inside the graph too."""
    model = serve_model(256, **shape).cuda()
    eager, graphed = engine_pair(model, max_num_seqs=8)
    batch = prompts([3, 17, 40, 9, 25])
    greedy = SamplingParams(max_tokens=24, temperature=0)
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    assert [r.outputs[0].token_ids for r in graphed.generate(batch, greedy)] == want
    assert graphed.runner.graphs.steps > 0


def built_in_the_background(engine: LLMEngine) -> LLMEngine:
    """`engine` once its background build has built every graph."""
    engine.warm_up()
    deadline = time.monotonic() + 600
    while not engine.runner.graphs.warm:
        assert time.monotonic() < deadline, "the background build did not finish"
        time.sleep(0.05)
    return engine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graphs_built_in_the_background_replay_what_eager_computes_on_gpu():
    """The graphs compile on a thread of their own, as off CUDA; the serving thread captures
    each the first time a step needs it; weights loaded after the capture are the ones its
    replays read (they are copied in place)."""
    model = serve_model(256).cuda()
    eager, graphed = engine_pair(model, max_num_seqs=8, compile_in_background=True)
    batch = prompts([3, 17, 40, 9, 25])
    greedy = SamplingParams(max_tokens=24, temperature=0)
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    assert [r.outputs[0].token_ids for r in built_in_the_background(graphed).generate(
        batch, greedy)] == want
    graphs = graphed.runner.graphs
    assert graphs.steps > 0 and graphs.late == 0
    torch.manual_seed(5)
    swapped = {name: tensor + 0.05 * torch.randn_like(tensor)
               for name, tensor in model.state_dict().items()}
    graphed.load_weights(swapped)  # the engines share `model`: eager reads them too
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    assert [r.outputs[0].token_ids for r in graphed.generate(batch, greedy)] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_a_cuda_graph_that_fails_to_capture_leaves_its_batch_size_eager_on_gpu(
        monkeypatch, caplog):
    import lathe.serve.decode_graph as decode_graph

    def refused(*args, **kwargs):
        raise RuntimeError("refused by this test")
    monkeypatch.setattr(decode_graph, "CapturedStep", refused)
    model = serve_model(256).cuda()
    eager, graphed = engine_pair(model, max_num_seqs=8, compile_in_background=True)
    batch = prompts([3, 17])
    greedy = SamplingParams(max_tokens=8, temperature=0)
    want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
    with caplog.at_level(logging.WARNING, logger="lathe.serve"):
        got = [r.outputs[0].token_ids for r in built_in_the_background(graphed).generate(
            batch, greedy)]
    assert got == want and graphed.runner.graphs.steps == 0
    assert "as a CUDA graph failed (RuntimeError: refused by this test)" in caplog.text


@pytest.mark.slow
def test_the_server_warms_its_decode_steps_up_before_health_turns_ok(checkpoint, caplog):
    """Healthy means every compiled step is built: concurrent requests then build none."""
    config = EngineConfig(compile_decode=True, max_num_seqs=4, block_size=4, num_blocks=128)
    with caplog.at_level(logging.INFO, logger="lathe.serve"), served(checkpoint,
                                                                    engine=config) as url:
        shapes = len(batch_buckets(4))
        assert f"warming up: {shapes}/{shapes} compiled decode steps built" in caplog.text

        def built() -> dict[str, float]:
            return {tuple(sample.labels.values()): sample.value
                    for family in text_string_to_metric_families(
                        httpx.get(f"{url}/metrics").text)
                    if family.name.startswith("lathe:decode_graphs")
                    for sample in family.samples}
        before = built()
        assert before[("tiny", "compiled")] + before[("tiny", "cached")] == shapes
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: httpx.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": f"story {i}", "max_tokens": 6 + i,
                "temperature": 0}, timeout=60).status_code, range(4)))
        assert answers == [200] * 4
        assert built() == before and before[("tiny",)] == 0


def at_full_priority(monkeypatch) -> None:
    """Background builds at the test process's own niceness: at a low one, a test waiting on
    them is starved by whatever the other test worker runs."""
    monkeypatch.setattr("lathe.serve.decode_graph.BUILDING_NICENESS",
                        os.getpriority(os.PRIO_PROCESS, 0))


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own niceness is Linux's")
def test_a_background_build_runs_at_a_low_cpu_priority_and_the_engine_does_not(monkeypatch):
    """The building thread (and the compilers it starts) at niceness BUILDING_NICENESS, so
    that steps served meanwhile take the cores first; the serving thread keeps its own."""
    from lathe.serve.decode_graph import BUILDING_NICENESS, DecodeGraphs
    niceness = []

    def recorded(self, shape, inputs):
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        self.stopping = True
        raise RuntimeError("not compiled in this test")
    monkeypatch.setattr(DecodeGraphs, "_build", recorded)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    _, compiled = engine_pair(serve_model(256), compile_in_background=True)
    compiled.warm_up()
    deadline = time.monotonic() + 60
    while any(t.name == "lathe-decode-graphs" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the background build did not end"
        time.sleep(0.01)
    assert niceness == [max(own, BUILDING_NICENESS)] and BUILDING_NICENESS > 0
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


@pytest.mark.slow
def test_a_server_answers_while_its_graphs_build_and_then_runs_them(checkpoint, monkeypatch):
    """`compile_in_background` (`lathe serve`'s default): /health is ok before any
    graph is built and requests are answered eagerly meanwhile, none waiting on a compile;
    once the graphs are built the same greedy requests run through them, to the same
    tokens; /metrics says how many are still pending."""
    from lathe.serve.decode_graph import DecodeGraphs
    at_full_priority(monkeypatch)
    gate = threading.Event()
    build = DecodeGraphs._build

    def held(self, shape, inputs):
        assert gate.wait(timeout=120), "the test never opened the gate"
        return build(self, shape, inputs)
    monkeypatch.setattr(DecodeGraphs, "_build", held)
    engines: list[LLMEngine] = []

    def load() -> LLMEngine:
        # the warm-up test's shapes: its graphs come from the session's cache, built or
        # loaded in the background alike
        engines.append(LLMEngine.from_checkpoint(checkpoint, EngineConfig(
            compile_decode=True, compile_in_background=True, max_num_seqs=4, block_size=4,
            num_blocks=128)))
        return engines[0]
    server, thread, url = start_server(checkpoint, load)
    try:
        wait_healthy(url)
        graphs = engines[0].runner.graphs
        shapes = len(graphs.shapes)

        def pending() -> float:
            return next(sample.value for family in text_string_to_metric_families(
                httpx.get(f"{url}/metrics").text) if family.name == "lathe:decode_graphs_pending"
                for sample in family.samples)

        def answers() -> list[str]:
            with ThreadPoolExecutor(4) as pool:
                return list(pool.map(lambda i: httpx.post(f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": f"story {i}", "max_tokens": 8,
                    "temperature": 0}, timeout=60).json()["choices"][0]["text"], range(4)))
        eager = answers()
        assert pending() == shapes and graphs.steps == 0 and not graphs.ready
        gate.set()
        deadline = time.monotonic() + 240
        while pending():  # the idle core sends fresh stats as each graph is built
            assert time.monotonic() < deadline, "the graphs were not built"
            time.sleep(0.1)
        assert graphs.warm and graphs.ready == set(graphs.buckets) and graphs.late == 0
        assert answers() == eager
        assert graphs.steps > 0
    finally:
        gate.set()
        server.should_exit = True
        thread.join(timeout=10)


def test_a_background_build_that_fails_keeps_what_it_built_and_runs_the_rest_eager(
        monkeypatch, caplog):
    """A compile that fails in the background leaves the buckets built by then compiled and
    the rest eager for good (never compiled under load), and says so; outputs equal
    eager's."""
    from lathe.serve.decode_graph import DecodeGraphs
    at_full_priority(monkeypatch)
    build = DecodeGraphs._build

    def only_one_row(self, shape, inputs):
        if shape[0] > 1:
            raise RuntimeError("Compiler: g++ not found")
        return build(self, shape, inputs)
    monkeypatch.setattr(DecodeGraphs, "_build", only_one_row)
    eager, compiled = engine_pair(serve_model(256), compile_in_background=True)
    with caplog.at_level(logging.WARNING, logger="lathe.serve"):
        compiled.warm_up()
        deadline = time.monotonic() + 120
        while "compiling the decode steps failed" not in caplog.text:
            assert time.monotonic() < deadline, "the background build did not end"
            time.sleep(0.05)
    graphs = compiled.runner.graphs
    assert "(but at batch sizes [1], built by then)" in caplog.text
    assert graphs.ready == {1} and not graphs.warm
    # /metrics: nothing pending any more, and the failure
    assert {key: value for key, value in graphs.stats().items()
            if key in ("decode_graphs_pending", "decode_graphs_failed")} == {
        "decode_graphs_pending": 0, "decode_graphs_failed": 1}
    greedy = SamplingParams(max_tokens=6, temperature=0)
    for batch in (prompts([5]), prompts([5, 7, 3, 9], seed=1)):
        want = [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
        assert [r.outputs[0].token_ids for r in compiled.generate(batch, greedy)] == want
    # the one-row steps alone ran compiled: the five decodes after the first token
    assert graphs.steps == 5 and graphs.late == 0


def test_a_background_build_of_a_closing_engine_ends_quietly(monkeypatch, caplog):
    """When the engine core closes mid-build (`stopping`), the build stops before its next
    shape, and an error the process's teardown raises under it is not logged as a failed
    compile: the core then exits at once instead of shutting the interpreter down under
    the thread (which crashed it: "terminate called", "can't register atexit")."""
    from lathe.serve.decode_graph import DecodeGraphs
    calls = []

    def torn_down(self, shape, inputs):
        calls.append(shape)
        self.stopping = True
        raise RuntimeError("can't register atexit after shutdown")
    monkeypatch.setattr(DecodeGraphs, "_build", torn_down)
    _, compiled = engine_pair(serve_model(256), compile_in_background=True)
    with caplog.at_level(logging.WARNING, logger="lathe.serve"):
        compiled.warm_up()
        deadline = time.monotonic() + 60
        while any(t.name == "lathe-decode-graphs" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the background build did not end"
            time.sleep(0.01)
    assert len(calls) == 1 and "failed" not in caplog.text
    assert not compiled.runner.graphs.warm and compiled.runner.graphs.ready == set()


def test_lathe_serve_compiles_decode_steps_unless_told_otherwise(checkpoint, monkeypatch):
    """Compiled by default, LoRA adapters too; --enforce-eager turns it off. Inductor's code
    is cached beside lathe's graphs."""
    import lathe.serve.server
    from lathe.serve.commands import serve_main
    configs = []
    monkeypatch.setattr(lathe.serve.server, "run", lambda config: configs.append(config))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    serve_main([str(checkpoint)])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache_root() / "inductor")
    serve_main([str(checkpoint), "--enforce-eager"])
    serve_main([str(checkpoint), "--lora", f"a={checkpoint}"])
    assert [c.engine.compile_decode for c in configs] == [True, False, True]


def test_a_warm_up_whose_compile_fails_leaves_an_eager_engine(monkeypatch, caplog):
    """No C++ compiler for inductor (or no Triton on a GPU) must not keep a server from
    starting: the engine serves eagerly and says why."""
    from lathe.serve.decode_graph import DecodeGraphs

    def no_compiler(self, shape, inputs):
        raise RuntimeError("Compiler: g++ not found")
    monkeypatch.setattr(DecodeGraphs, "_build", no_compiler)
    model = serve_model(256)
    eager, compiled = engine_pair(model)
    compiled.warm_up()
    assert compiled.runner.graphs is None
    assert not any(key.startswith("decode_graphs_") for key in compiled.stats())
    assert "g++ not found" in caplog.text and "serving eagerly" in caplog.text
    batch = prompts([5, 9])
    greedy = SamplingParams(max_tokens=6, temperature=0)
    assert [r.outputs[0].token_ids for r in compiled.generate(batch, greedy)] == \
        [r.outputs[0].token_ids for r in eager.generate(batch, greedy)]
