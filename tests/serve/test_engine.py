"""The paged, continuously batched engine against naive full-recompute decoding."""

from __future__ import annotations

import gc
import shutil
import weakref

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lathe.core.errors import ConfigError
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.request_checks import RequestError
from lathe.serve.sampling_params import SamplingError, SamplingParams
from tests.builders import GEMMA4_E2B, serve_model


@torch.inference_mode()
def naive_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def prompts(lengths, vocab=256, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def engine_for(model, **config) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(**{"block_size": 4, "num_blocks": 256,
                                                  **config}))


def test_batched_paged_greedy_equals_naive_recompute_token_for_token():
    model = serve_model(256)
    batch = prompts([3, 17, 40, 70, 1])
    max_tokens = [5, 20, 9, 30, 12]
    # a 24-token budget forces chunked prefills sharing steps with decodes
    engine = engine_for(model, max_num_batched_tokens=24)
    params = [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens]
    results = engine.generate(batch, params)
    for prompt, m, result in zip(batch, max_tokens, results, strict=True):
        assert result.outputs[0].token_ids == naive_greedy(model, prompt, m)
        assert result.outputs[0].finish_reason == "length"
    assert engine.block_manager.usage == 0 and not engine.has_unfinished()


def test_prefix_cache_hit_gives_identical_output_and_counts():
    model = serve_model(256)
    engine = engine_for(model)
    (prompt,) = prompts([30])
    params = SamplingParams(max_tokens=8, temperature=0)
    first = engine.generate([prompt], params)[0].outputs[0].token_ids
    hits = engine.block_manager.prefix_hits
    second = engine.generate([prompt], params)[0]
    assert second.outputs[0].token_ids == first == naive_greedy(model, prompt, 8)
    assert engine.block_manager.prefix_hits - hits == 28  # 7 full blocks; the last is recomputed
    uncached = engine_for(model, prefix_caching=False)  # --no-enable-prefix-caching
    for _ in range(2):
        assert uncached.generate([prompt], params)[0].outputs[0].token_ids == first
    assert uncached.block_manager.prefix_hits == 0


def test_pool_is_empty_after_finished_and_aborted_requests():
    engine = engine_for(serve_model(256), num_blocks=64)
    ids = [engine.add_request(p, SamplingParams(max_tokens=40, temperature=1.0, seed=i))
           for i, p in enumerate(prompts([9, 21, 33]))]
    for _ in range(3):
        engine.step()
    assert engine.block_manager.usage > 0
    engine.abort(ids[1])
    waiting = engine.add_request(prompts([5])[0], SamplingParams(max_tokens=4))
    engine.abort(waiting)  # aborted before it was ever scheduled
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free == 64 and engine.requests == {}


def test_tiny_cache_preempts_and_every_request_still_completes_exactly():
    model = serve_model(256)
    batch = prompts([10, 14, 6, 12], seed=1)
    engine = engine_for(model, num_blocks=12)  # 48 slots for 4 sequences of up to 30 tokens
    results = engine.generate(batch, SamplingParams(max_tokens=16, temperature=0))
    assert engine.scheduler.num_preemptions > 0
    for prompt, result in zip(batch, results, strict=True):
        assert result.outputs[0].token_ids == naive_greedy(model, prompt, 16)
    assert engine.block_manager.num_free == 12


def test_a_preempted_sequences_row_goes_to_a_new_one_before_the_rows_grow():
    """A preempted sequence starts again when it is readmitted, so a sequence admitted before
    it (the scheduler skips one it cannot admit yet) takes its row: running sequences, at
    most `max_num_seqs`, never grow the rows (nor the linear-attention states a compiled
    step was built over)."""
    from lathe.serve.sequence import Sequence, Status

    engine = engine_for(serve_model(256), num_blocks=20, max_num_seqs=2)
    runner = engine.runner
    first, preempted, admitted = (Sequence(str(i), 0, prompt, SamplingParams())
                                  for i, prompt in enumerate(prompts([5, 6, 7])))
    for seq in (first, preempted):
        seq.status = Status.RUNNING
        runner._row(seq)
    preempted.status = Status.WAITING
    runner._row(admitted)
    assert runner.tables.shape[0] == 2 and set(runner.rows) == {first, admitted}


def test_runner_rows_are_reused_grown_and_rewritten_after_preemption():
    """The model runner's persistent block-table rows: more live sequences than rows grow
    the table, preempted sequences' reallocated blocks are rewritten, finished ones give
    their rows back — and every completion, n > 1 included, is still naive greedy."""
    model = serve_model(256)
    batch = prompts([10, 14, 6, 12, 9, 11], seed=2)
    engine = engine_for(model, num_blocks=20, max_num_seqs=6)
    engine.runner = engine.executor.runner = type(engine.runner)(
        model, engine.slabs, engine.device, engine.max_model_len, rows=2)
    params = SamplingParams(max_tokens=14, temperature=0, n=2)
    results = engine.generate(batch, params)
    assert engine.scheduler.num_preemptions > 0
    assert engine.runner.tables.shape[0] >= 8 and engine.runner.rows == {}
    for prompt, result in zip(batch, results, strict=True):
        expected = naive_greedy(model, prompt, 14)
        assert [o.token_ids for o in result.outputs] == [expected, expected]


def test_same_seed_same_sample_and_n_shares_the_prompt_blocks():
    engine = engine_for(serve_model(256))
    (prompt,) = prompts([26])
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, n=3)
    a, b = (engine.generate([prompt], sampled)[0] for _ in range(2))
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3  # seed + index per completion
    other = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=8)
    assert engine.generate([prompt], other)[0].outputs[0].token_ids != a.outputs[0].token_ids

    fresh = engine_for(serve_model(256))
    fresh.generate([prompt], SamplingParams(max_tokens=4, temperature=0, n=4))
    assert fresh.block_manager.prefix_hits == 3 * 24  # siblings reuse the first's 6 blocks


def test_logprobs_are_the_models_log_softmax():
    model = serve_model(256)
    engine = engine_for(model)
    (prompt,) = prompts([11])
    out = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0,
                                                   logprobs=4))[0].outputs[0]
    ids = prompt + out.token_ids
    with torch.inference_mode():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    for t, lp in enumerate(out.logprobs):
        row = reference[len(prompt) - 1 + t]
        assert lp.token_id == out.token_ids[t]
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-5)
        assert [i for i, _ in lp.top] == row.topk(4).indices.tolist()


def test_load_weights_swaps_the_model_and_forgets_cached_prefixes():
    engine = engine_for(serve_model(256))
    (prompt,) = prompts([20])
    params = SamplingParams(max_tokens=6, temperature=0)
    engine.generate([prompt], params)
    new = serve_model(256, init_std=0.1)
    engine.load_weights(new.state_dict())
    assert engine.block_manager.cached == {}
    assert engine.generate([prompt], params)[0].outputs[0].token_ids == naive_greedy(
        new, prompt, 6)


@pytest.mark.parametrize("config", [{}, {"max_loras": 2}], ids=["plain", "adapters"])
def test_a_dropped_engine_is_freed_at_once_with_its_kv_cache(config):
    """No reference cycle holds an engine: on a GPU the next engine sizes its KV cache from
    the memory left free, so a dropped engine waiting for the cyclic collector would leave the
    next one a negative budget (as the serve bench's second engine found on an H200)."""
    engine = LLMEngine(serve_model(256), config=EngineConfig(block_size=4, num_blocks=64,
                                                             **config))
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
    engine_ref, slabs_ref = weakref.ref(engine), weakref.ref(engine.slabs)
    gc.disable()
    try:
        del engine
        assert engine_ref() is None and slabs_ref() is None
    finally:
        gc.enable()


def test_requests_over_the_context_window_are_refused_with_both_numbers():
    engine = engine_for(serve_model(256))
    with pytest.raises(RequestError, match="maximum context length is 256 .* prompt has 250 "
                                           "tokens and max_tokens is 10"):
        engine.add_request([1] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request([300], SamplingParams())


def test_max_model_len_caps_requests_the_table_and_the_default_kv_budget():
    """vLLM's --max-model-len on a model of 256 positions: requests past 40 tokens are
    refused with that number, a sequence stops at it, each table row holds its blocks and
    no more, and the default budget holds max_num_seqs sequences of it; past the model's
    own length it is refused, naming both."""
    model = serve_model(256)
    engine = LLMEngine(model, config=EngineConfig(max_num_seqs=3, max_model_len=40))
    assert engine.max_model_len == engine.limits.max_model_len == 40
    with pytest.raises(RequestError, match="maximum context length is 40 .* prompt has 35 "
                                           "tokens and max_tokens is 6"):
        engine.add_request([1] * 35, SamplingParams(max_tokens=6))
    (out,) = engine.generate([[1] * 35], SamplingParams(max_tokens=5, temperature=0,
                                                        ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    assert engine.runner.max_blocks == 3  # 40 tokens in blocks of 16
    assert len(engine.block_manager.blocks) == 3 * 3
    with pytest.raises(ConfigError, match=r"max_model_len=257 exceeds this model's "
                                          r"max_position_embeddings \(256\).*<= 256"):
        LLMEngine(model, config=EngineConfig(max_model_len=257))
    with pytest.raises(ConfigError, match="max_model_len=0 must be >= 1"):
        EngineConfig(max_model_len=0)


def test_text_stop_strings_and_eos_from_a_checkpoint(checkpoint):
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=64))
    prompt = "The river"
    free = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                    ignore_eos=True))[0].outputs[0]
    pieces = [engine.tokenizer.decode(free.token_ids[:i]) for i in range(len(free.token_ids))]
    boundary = next(len(p) for p in pieces if 3 <= len(p) < len(free.text) - 2)
    stop = free.text[boundary - 2:boundary + 2]  # spans a token boundary
    stopped = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                       stop=[stop], ignore_eos=True))[0]
    out = stopped.outputs[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert out.text == free.text[:free.text.index(stop)]
    eos = engine.eos_token_ids
    assert eos, "generation_config.json names the chat EOS"
    forced = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                      stop_token_ids=[free.token_ids[2]]))[0]
    assert forced.outputs[0].token_ids == free.token_ids[:3]
    assert forced.outputs[0].finish_reason == "stop"


def test_a_prompt_past_the_token_budget_prefills_alone_across_steps():
    model = serve_model(256, max_seq_len=1024)
    (prompt,) = prompts([600])
    engine = engine_for(model, max_num_batched_tokens=64)  # 10 steps with no row to sample
    result = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]
    assert result.outputs[0].token_ids == naive_greedy(model, prompt, 3)


def test_prompt_logprobs_score_every_prompt_token_across_chunks_cache_and_preemption():
    model = serve_model(256)
    (prompt,) = prompts([60])
    (short,) = prompts([9], seed=3)
    with torch.inference_mode():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    engine = engine_for(model, max_num_batched_tokens=16, num_blocks=18)
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # now cached
    hits = engine.block_manager.prefix_hits
    # `short` is admitted first and keeps growing: the scored prompt, admitted after it
    # into the last free blocks, is preempted mid-prefill and later recomputed
    other, scored = engine.generate(
        [short, prompt], [SamplingParams(max_tokens=40, temperature=0),
                          SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3, n=2)])
    assert engine.scheduler.num_preemptions > 0
    entries = scored.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for t, entry in enumerate(entries[1:], start=1):
        row = reference[t - 1]
        assert entry.token_id == prompt[t]
        assert entry.logprob == pytest.approx(float(row[prompt[t]]), abs=1e-5)
        assert [i for i, _ in entry.top] == row.topk(3).indices.tolist()
    # the scored prompt computed every position itself; only its sibling read the cache
    assert engine.block_manager.prefix_hits - hits <= 56
    assert [o.token_ids for o in scored.outputs] == [naive_greedy(model, prompt, 4)] * 2
    assert other.outputs[0].token_ids == naive_greedy(model, short, 40)


def test_logit_bias_steers_greedy_and_sampled_tokens():
    engine = engine_for(serve_model(256))
    (prompt,) = prompts([12])
    for temperature in (0.0, 1.0):
        forced = engine.generate([prompt], SamplingParams(
            max_tokens=6, temperature=temperature, seed=0, logit_bias={42: 100.0}))[0]
        assert forced.outputs[0].token_ids == [42] * 6
    free = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    banned = free.outputs[0].token_ids[0]
    avoided = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0,
                                                       logit_bias={banned: -100.0}))[0]
    assert avoided.outputs[0].token_ids != [banned]
    with pytest.raises(SamplingError, match=r"logit_bias=\{1: 101.0\} must be"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(RequestError, match="logit_bias token ids \\[999\\]"):
        engine.add_request(prompt, SamplingParams(logit_bias={999: 1.0}))


@pytest.mark.parametrize("seed", [2**64, 18446744073709551615, -(2**63) - 1])
def test_seeds_outside_64_bits_are_refused_and_the_edges_work(seed):
    with pytest.raises(SamplingError, match=r"seed=.* must be in \[-9223372036854775808, "):
        SamplingParams(seed=seed)
    engine = engine_for(serve_model(256))
    (prompt,) = prompts([5])
    for edge in (2**63 - 1, -(2**63)):
        params = SamplingParams(max_tokens=4, seed=edge, n=2)
        first, again = (engine.generate([prompt], params)[0] for _ in range(2))
        assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]


@pytest.mark.parametrize("paged_up_to", [0, 24, 512])
def test_prefills_attend_alike_by_span_or_token_by_token(paged_up_to, monkeypatch):
    """On CPU a prefill chunk whose context's K/V fit PAGED_PREFILL_BYTES attends token by
    token through the paged kernel, the rest as a span through SDPA: with contexts of up to
    none, 24 and 512 tokens under the limit (a 24-token budget mixes both kinds in one
    step), the same greedy tokens as full recompute."""
    from lathe.serve import model_runner
    model = serve_model(256)
    engine = engine_for(model, max_num_batched_tokens=24)
    per_token = 2 * engine.slabs.k[0][0].nbytes
    monkeypatch.setattr(model_runner, "PAGED_PREFILL_BYTES", paged_up_to * per_token)
    batch = prompts([3, 17, 40, 70, 1], seed=7)
    results = engine.generate(batch, SamplingParams(max_tokens=6, temperature=0))
    for prompt, result in zip(batch, results, strict=True):
        assert result.outputs[0].token_ids == naive_greedy(model, prompt, 6)


@pytest.mark.parametrize("paged_up_to", [0, 512])
def test_kv_sharing_layers_run_only_the_rows_a_step_samples(paged_up_to, monkeypatch):
    """Gemma 4 E2B's last layers store no keys or values, so a step runs them on the rows
    it samples alone — a chunk's last token, every row of a prompt whose log-probs are
    asked — with prefill chunks attending by span or token by token: the same greedy
    tokens and prompt log-probs as full recompute, and far fewer rows through them."""
    from lathe.serve import model_runner
    model = serve_model(256, **GEMMA4_E2B)
    batch = prompts([3, 17, 40, 70, 1], seed=7)
    expected = [naive_greedy(model, prompt, 6) for prompt in batch]
    (prompt,) = prompts([30], seed=8)
    with torch.inference_mode():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    rows = {3: 0, 5: 0}  # the rows through layer 3 (a source) and layer 5 (sharing its KV)
    for i in rows:
        model.model.layers[i].register_forward_pre_hook(
            lambda _, args, i=i: rows.__setitem__(i, rows[i] + args[0].shape[1]))
    engine = engine_for(model, max_num_batched_tokens=24)
    per_token = 2 * engine.slabs.k[0][0].nbytes
    monkeypatch.setattr(model_runner, "PAGED_PREFILL_BYTES", paged_up_to * per_token)
    kept, run = [], engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda ids, view, keep, *rest: (
        kept.append(len(keep)), run(ids, view, keep, *rest))[1])
    results = engine.generate(batch, SamplingParams(max_tokens=6, temperature=0))
    assert [result.outputs[0].token_ids for result in results] == expected
    assert rows[3] == 131 + 5 * 5 and rows[5] == sum(kept) < rows[3] / 3  # prompts + decodes
    scored = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0,
                                                      prompt_logprobs=1))[0]
    for t, entry in enumerate(scored.prompt_logprobs[1:], start=1):  # fp32 noise: ~1e-5
        assert entry.logprob == pytest.approx(float(reference[t - 1, prompt[t]]), abs=5e-5)


@pytest.mark.skipif(shutil.which("c++") is None, reason="the native kernels need a C++ compiler")
def test_the_engines_cpu_steps_take_the_native_element_wise_ops():
    """On CPU the engine's eager forwards run inside `native_inference`, so they take the
    native norms, SwiGLU and RoPE; the same model called outside the engine does not."""
    model = serve_model(256)
    engine = engine_for(model)
    native = {"lathe::rms_norm_cpu", "lathe::add_rms_norm_cpu", "lathe::swiglu_cpu",
              "lathe::rope_cpu"}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = engine.generate(prompts([9]), SamplingParams(max_tokens=4, temperature=0))
    assert native <= {event.key for event in prof.key_averages()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        expected = naive_greedy(model, prompts([9])[0], 4)
    assert not native & {event.key for event in prof.key_averages()}
    assert result[0].outputs[0].token_ids == expected


@pytest.mark.skipif(shutil.which("c++") is None, reason="the native kernels need a compiler")
def test_a_served_checkpoint_decodes_through_native_linears_as_plain_linears_do(checkpoint):
    """`LLMEngine.from_checkpoint` serves through `DecodeLinear`s (decode rows on the native
    op): the same greedy tokens, and log-probs within 1e-4, as the model's plain linears,
    over prefills, mixed steps and decodes of several sequences at once."""
    from lathe.kernels.cpu_native import load_cpu_kernels
    from lathe.kernels.decode_linear import DecodeLinear
    from lathe.model import load_checkpoint

    assert load_cpu_kernels()
    served = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=256,
                                                                max_num_batched_tokens=64))
    kinds = {type(m) for m in served.model.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {DecodeLinear}
    plain = LLMEngine(load_checkpoint(checkpoint), config=EngineConfig(
        num_blocks=256, max_num_batched_tokens=64))
    vocab = served.model.config.vocab_size
    batch = prompts([5, 40, 17, 3, 60, 9], vocab=vocab, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=0, ignore_eos=True)
    for a, b in zip(served.generate(batch, params), plain.generate(batch, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in a.outputs[0].logprobs]),
                                   torch.tensor([lp.logprob for lp in b.outputs[0].logprobs]),
                                   atol=1e-4, rtol=0)


def test_the_default_kv_budget_holds_max_num_seqs_full_sequences_up_to_a_cap(monkeypatch):
    """Without kv_cache_memory_mb the cache holds every sequence at full length (no
    preemption from a too-small default), up to DEFAULT_KV_MB; a given budget wins."""
    from lathe.serve import paged_cache
    model = serve_model(256)  # 256 positions: 16 blocks of 16 a sequence
    engine = LLMEngine(model, config=EngineConfig(max_num_seqs=3))
    assert len(engine.block_manager.blocks) == 3 * 16
    per_block = engine.slabs.nbytes // (len(engine.block_manager.blocks) + 1)
    monkeypatch.setattr(paged_cache, "DEFAULT_KV_MB", 20 * per_block / 2**20)
    assert len(LLMEngine(model, config=EngineConfig(max_num_seqs=3)).block_manager.blocks) == 19
    given = LLMEngine(model, config=EngineConfig(max_num_seqs=3, kv_cache_memory_mb=(
        8 * per_block / 2**20)))
    assert len(given.block_manager.blocks) == 7  # the slabs' scratch block is in the budget


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_set_kv_budget_sizes_the_cache_instead_of_the_cards_share():
    model = serve_model(256).cuda()
    share = LLMEngine(model, config=EngineConfig(max_num_seqs=3))
    per_block = share.slabs.nbytes // (len(share.block_manager.blocks) + 1)
    assert len(share.block_manager.blocks) > 1000  # 90% of a card: far beyond 3 sequences
    del share
    given = LLMEngine(model, config=EngineConfig(kv_cache_memory_mb=8 * per_block / 2**20))
    assert len(given.block_manager.blocks) == 7
