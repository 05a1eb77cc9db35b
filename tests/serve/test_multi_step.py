"""Multi-step decoding (`EngineConfig.decode_steps`): several forward passes per engine
step give the tokens, log-probs and stops of one pass per step — across mixed steps, n > 1,
prefix-cache hits, a cache too small to reserve every pass, bf16 weights, compiled decode
and the streaming server — while penalized rows and steps with prefills run one pass; the
setting is refused where it cannot apply."""

from __future__ import annotations

import openai
import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.serve.commands import serve_main
from lathe.serve.config import EngineConfig, SpeculativeConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.sampling_params import SamplingParams
from tests.builders import serve_model
from tests.serve.conftest import start_server, wait_healthy
from tests.serve.test_engine import engine_for, naive_greedy, prompts


def outputs(engine: LLMEngine, batch, params) -> list[list[tuple]]:
    return [[(o.token_ids, o.finish_reason,
              [(lp.token_id, round(lp.logprob, 4), [(t, round(v, 4)) for t, v in lp.top])
               for lp in o.logprobs]) for o in r.outputs]
            for r in engine.generate(batch, params)]


def count_passes(engine: LLMEngine) -> list[int]:
    """Records, per engine step, how many forward passes it ran."""
    passes: list[int] = []
    run = engine.runner.run

    def counted(*args, **kwargs):
        passes[-1] += 1
        return run(*args, **kwargs)
    step = engine.step

    def counted_step():
        passes.append(0)
        return step()
    engine.runner.run, engine.step = counted, counted_step
    return passes


def multi_step_matches(model, batch, params, decode_steps: int,
                       **config) -> tuple[LLMEngine, list[int], list]:
    """An engine of `decode_steps` passes a step, asserted to give what one pass a step
    gives on `batch`: the engine, its passes per step, and the outputs."""
    want = outputs(engine_for(model, **config), batch, params)
    multi = engine_for(model, decode_steps=decode_steps, **config)
    passes = count_passes(multi)
    assert outputs(multi, batch, params) == want
    return multi, passes, want


def test_greedy_tokens_match_one_pass_per_step_across_mixed_steps_and_n():
    """A 24-token budget puts chunked prefills beside decodes; max_tokens that are not
    multiples of the step count; n = 2 shares a prompt through the prefix cache."""
    model = serve_model(256)
    batch = prompts([3, 17, 40, 9])
    params = [SamplingParams(max_tokens=m, temperature=0, n=n, logprobs=2 if n == 2 else None)
              for m, n in ((11, 1), (20, 2), (6, 1), (13, 1))]
    multi, passes, want = multi_step_matches(model, batch, params, 4,
                                             max_num_batched_tokens=24)
    assert max(passes) == 4
    for prompt, result, m in zip(batch, want, (11, 20, 6, 13), strict=True):
        assert result[0][0] == naive_greedy(model, prompt, m)
    assert multi.block_manager.usage == 0 and multi.requests == {}
    hits = multi.block_manager.prefix_hits
    again = outputs(multi, batch[1:2], params[1])[0]
    assert [tokens for tokens, _, _ in again] == [tokens for tokens, _, _ in want[1]]
    assert multi.block_manager.prefix_hits > hits


def test_one_sequence_decodes_in_runs_of_decode_steps_tokens():
    engine = engine_for(serve_model(256), decode_steps=4)
    passes = count_passes(engine)
    engine.add_request(prompts([10])[0], SamplingParams(max_tokens=14, temperature=0))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    # the prefill samples the first token; 13 more come as 4 + 4 + 4 + 1 (max_tokens caps
    # the last run, so no pass is wasted past it)
    assert passes == [1, 4, 4, 4, 1]
    assert [len(d.token_ids) for d in deltas] == [1, 4, 4, 4, 1]
    assert deltas[-1].finish_reason == "length"


def test_a_stop_token_inside_a_run_ends_the_sequence_exactly_there():
    model = serve_model(256)
    (prompt,) = prompts([20], seed=1)
    free = naive_greedy(model, prompt, 16)
    stop = free[6]  # the run of tokens 5-8 meets it at its second token
    assert free.index(stop) == 6
    params = SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop])
    engine = engine_for(model, decode_steps=4)
    out = engine.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == free[:7] and out.finish_reason == "stop"
    assert engine.block_manager.usage == 0


def test_seeded_sampling_and_logprobs_match_one_pass_per_step():
    """Each seeded row draws from its own generator, one draw per pass either way."""
    model = serve_model(256)
    batch = prompts([7, 11, 5], seed=4)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_k=30, top_p=0.95, min_p=0.01,
                             seed=s, logprobs=3) for s in (1, 2, 3)]
    _, passes, _ = multi_step_matches(model, batch, params, 5)
    assert max(passes) == 5


def test_penalized_rows_run_one_pass_per_step():
    """Penalties read the sequence's tokens, which a run hands over only at its end."""
    model = serve_model(256)
    batch = prompts([6, 9], seed=5)
    params = [SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3),
              SamplingParams(max_tokens=10, temperature=0)]
    _, passes, _ = multi_step_matches(model, batch, params, 4)
    assert max(passes) == 1


def test_runs_shrink_to_the_blocks_free_and_never_preempt():
    """12 blocks of 4 slots for 4 sequences of up to 30 tokens: one pass per step
    preempts; reserving later passes takes only free blocks, so tokens stay exact."""
    model = serve_model(256)
    batch = prompts([10, 14, 6, 12], seed=1)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    single = engine_for(model, num_blocks=12)
    multi = engine_for(model, num_blocks=12, decode_steps=8)
    passes = count_passes(multi)
    results = multi.generate(batch, greedy)
    for prompt, result in zip(batch, results, strict=True):
        assert result.outputs[0].token_ids == naive_greedy(model, prompt, 16)
    single.generate(batch, greedy)
    assert multi.scheduler.num_preemptions <= single.scheduler.num_preemptions
    assert 1 < max(passes) <= 8
    assert multi.block_manager.num_free == 12


def test_bf16_weights_decode_in_runs_as_one_pass_a_step():
    """bf16 is the GPU default: the sampled tokens fed back are the ids a bf16 model takes,
    and a run picks one pass a step's tokens."""
    model = serve_model(256).to(torch.bfloat16)
    batch = prompts([5, 12, 8], seed=6)
    greedy = SamplingParams(max_tokens=9, temperature=0)
    multi, passes, _ = multi_step_matches(model, batch, greedy, 4)
    assert max(passes) == 4 and multi.slabs.k[0].dtype == torch.bfloat16


def test_the_server_streams_runs_as_one_pass_a_step_does(checkpoint):
    """Through the OpenAI API, with a stop string that a run of passes meets midway: the
    streamed text and finish reason of an engine that runs one pass a step."""
    single = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=128))
    ids = single.encode("The river")
    free = single.generate([ids], SamplingParams(max_tokens=24, temperature=0,
                                                 ignore_eos=True))[0].outputs[0].text
    stop = free[len(free) // 2:len(free) // 2 + 2]
    want = single.generate([ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                 stop=[stop]))[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.text) < len(free)
    server, thread, url = start_server(checkpoint, lambda: LLMEngine.from_checkpoint(
        checkpoint, EngineConfig(num_blocks=128, decode_steps=4)))
    try:
        wait_healthy(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        chunks = list(client.completions.create(
            model="tiny", prompt="The river", max_tokens=24, temperature=0, stop=[stop],
            stream=True, extra_body={"ignore_eos": True}))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_compiled_multi_step_matches_eager_token_for_token():
    """The later passes of a compiled run take the sampled tokens straight from the last
    pass, through padded buckets (3 rows run as 4)."""
    model = serve_model(256)
    batch = prompts([3, 17, 40])
    params = [SamplingParams(max_tokens=m, temperature=0) for m in (12, 21, 9)]
    want = outputs(engine_for(model), batch, params)
    compiled = engine_for(model, max_num_seqs=4, compile_decode=True, decode_steps=4)
    assert outputs(compiled, batch, params) == want
    assert compiled.runner.graphs.steps > 0


def test_decode_steps_is_refused_where_it_cannot_apply(checkpoint):
    with pytest.raises(ConfigError, match="decode_steps=0 must be >= 1"):
        EngineConfig(decode_steps=0)
    with pytest.raises(ConfigError, match="cannot be combined with speculative"):
        EngineConfig(decode_steps=4, speculative=SpeculativeConfig("ngram"))
    with pytest.raises(ConfigError, match="--decode-steps=0 must be >= 1"):
        serve_main([str(checkpoint), "--decode-steps", "0"])
    with pytest.raises(ConfigError, match="--decode-steps=2 cannot .* set --decode-steps=1 "
                                          "or turn speculative decoding off"):
        serve_main([str(checkpoint), "--decode-steps", "2", "--speculative", "ngram"])
