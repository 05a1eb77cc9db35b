"""Speculative decoding: greedy output identical to plain decoding whatever the batch,
preemption or prefix cache; sampled output distributed exactly as the target's."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.data.tokenizer import save_tokenizer, train_tokenizer
from lathe.model import save_checkpoint
from lathe.model.checkpoint import CheckpointError
from lathe.serve import speculative
from lathe.serve.config import EngineConfig, SpeculativeConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.request_checks import RequestError
from lathe.serve.sampling_params import SamplingParams
from lathe.serve.sequence import Sequence
from lathe.serve.speculative import Draft, NgramProposer
from tests.builders import serve_model
from tests.serve.conftest import start_server, wait_healthy
from tests.serve.test_engine import prompts

REPEATING = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, [3, 1, 4, 1, 5, 9, 2, 6] * 3]


def engine(model, speculative_config=None, draft=None, **config) -> LLMEngine:
    return LLMEngine(model, config=EngineConfig(**{
        "block_size": 4, "num_blocks": 256, "speculative": speculative_config, **config}),
        draft_model=draft)


def outputs(results) -> list[list[list[int]]]:
    return [[out.token_ids for out in result.outputs] for result in results]


SETUPS = {
    "ngram": lambda model: (SpeculativeConfig("ngram", 3), None),
    "draft": lambda model: (SpeculativeConfig("draft", 3), serve_model(256, n_layers=1,
                                                                       init_std=0.1)),
}


@pytest.mark.parametrize("method", SETUPS)
def test_greedy_speculation_is_plain_decoding_token_for_token(method):
    model = serve_model(256)
    batch = prompts([3, 17, 40, 70, 1]) + REPEATING
    params = [SamplingParams(max_tokens=m, temperature=0, n=n)
              for m, n in zip([5, 20, 9, 30, 12, 25, 25, 18], [1, 2, 1, 1, 3, 1, 2, 1],
                              strict=True)]
    # a 24-token budget mixes chunked prefills, decodes and verifications in one step
    plain = engine(model, max_num_batched_tokens=24)
    spec_config, draft = SETUPS[method](model)
    spec = engine(model, spec_config, draft, max_num_batched_tokens=24)
    assert outputs(spec.generate(batch, params)) == outputs(plain.generate(batch, params))
    stats = spec.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert spec.block_manager.usage == 0 and not spec.runner.rows
    if draft is not None:
        # the draft's KV bookkeeping is freed with each sequence
        assert not spec.speculator.drafter.written


def test_the_target_as_its_own_draft_accepts_every_token():
    """The draft's paged KV (catch-up after prefill, prefix hits, roll-back) is exactly
    the target's: with the same weights every draft token is the target's argmax."""
    model = serve_model(256)
    spec = engine(model, SpeculativeConfig("draft", 4), model, max_num_batched_tokens=24)
    batch = prompts([3, 17, 40, 70, 1])
    params = SamplingParams(max_tokens=21, temperature=0)
    first = outputs(spec.generate(batch, params))
    again = outputs(spec.generate(batch, params))  # every full prompt block from the cache
    assert first == again == outputs(engine(model).generate(batch, params))
    assert spec.block_manager.prefix_hits > 0
    stats = spec.stats()
    assert stats["spec_decode_acceptance_rate"] == 1.0
    assert stats["spec_decode_mean_acceptance_length"] > 4.0


@pytest.mark.parametrize("method", SETUPS)
def test_preemption_under_speculation_keeps_greedy_output(method):
    model = serve_model(256)
    batch = prompts([9, 21, 33, 12, 5, 17], seed=3) + REPEATING
    params = SamplingParams(max_tokens=30, temperature=0)
    reference = outputs(engine(model).generate(batch, params))
    spec_config, draft = SETUPS[method](model)
    small = engine(model, spec_config, draft, num_blocks=40)
    assert outputs(small.generate(batch, params)) == reference
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.usage == 0


def test_speculative_steps_respect_max_tokens_stop_tokens_and_logprobs():
    model = serve_model(256)
    plain = engine(model)
    spec = engine(model, SpeculativeConfig("draft", 4), model)
    batch = REPEATING
    base = plain.generate(batch, SamplingParams(max_tokens=12, temperature=0, logprobs=2))
    stop = base[0].outputs[0].token_ids[5]
    params = [SamplingParams(max_tokens=12, temperature=0, logprobs=2),
              SamplingParams(max_tokens=7, temperature=0, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0, logprobs=2, stop_token_ids=[stop])]
    for got, want, p in zip(spec.generate(batch, params), plain.generate(batch, params), params,
                            strict=True):
        out, ref = got.outputs[0], want.outputs[0]
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
        assert len(out.token_ids) <= p.max_tokens
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        for a, b in zip(out.logprobs, ref.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert spec.stats()["spec_decode_mean_acceptance_length"] > 1


def test_seeded_sampling_under_speculation_is_reproducible():
    model = serve_model(256)
    draft = serve_model(256, n_layers=1, init_std=0.1)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, n=3)
    runs = [outputs(engine(model, SpeculativeConfig("draft", 3), draft).generate(
        REPEATING, params)) for _ in range(2)]
    assert runs[0] == runs[1]


def test_ngram_proposer_takes_the_latest_longest_match():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=1,
                                               prompt_lookup_max=3))

    def seq(tokens):
        return Sequence("r", 0, tokens, SamplingParams())

    # the suffix [1, 2] occurs twice; the later occurrence (followed by 7, 8) wins
    assert proposer.propose(seq([1, 2, 3, 4, 1, 2, 7, 8, 1, 2]), 3).tokens == [7, 8, 1]
    # only the 1-token suffix [9] matches
    assert proposer.propose(seq([5, 9, 6, 3, 9]), 3).tokens == [6, 3, 9]
    assert proposer.propose(seq([1, 2, 3]), 3) is None
    # a match near the end continues its period: a repeated token, a repeated phrase
    assert proposer.propose(seq([4, 7, 7, 7, 7]), 3).tokens == [7, 7, 7]
    assert proposer.propose(seq([1, 2, 3, 1, 2, 3, 1, 2]), 4).tokens == [3, 1, 2, 3]


# the sampled-distribution test: a 16-token vocabulary, so the exact distribution of the
# tokens after a prompt can be enumerated from the target model


def exact_distribution(model, prompt: list[int], steps: int, temperature: float) -> torch.Tensor:
    """P(t1, ..., t_steps | prompt) under the target, as a (16,) * steps tensor."""
    vocab = model.config.vocab_size
    paths = torch.tensor([prompt])
    probs = torch.ones(1)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(paths).logits[:, -1].float() / temperature
            step = torch.softmax(logits, dim=-1)  # (paths, vocab)
            probs = (probs[:, None] * step).reshape(-1)
            paths = torch.cat([paths.repeat_interleave(vocab, 0),
                               torch.arange(vocab).repeat(len(paths))[:, None]], dim=1)
    return probs.reshape((vocab,) * steps)


def sampled_counts(spec_engine, prompt, steps, temperature, draws) -> torch.Tensor:
    vocab = spec_engine.model.config.vocab_size
    params = [SamplingParams(max_tokens=steps, temperature=temperature, seed=16 * s, n=16)
              for s in range(draws // 16)]
    counts = torch.zeros((vocab,) * steps)
    for result in spec_engine.generate([prompt] * len(params), params):
        for out in result.outputs:
            counts[tuple(out.token_ids)] += 1
    return counts


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over cells expected >= 5 times (the rest pooled), and its df."""
    expected = probs.reshape(-1) * counts.sum()
    observed = counts.reshape(-1)
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    o = torch.cat([observed[big], observed[~big].sum()[None]])
    return float(((o - e) ** 2 / e.clamp(min=1e-9)).sum()), int(big.sum())


def always_accept(target, draft, generator):
    token = int(speculative.exponential_race(target[len(draft.tokens)][None], [generator])[0])
    return draft.tokens + [token]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_tokens_follow_the_targets_distribution(method, monkeypatch):
    """Four tokens after a prompt (the last three from drafting steps), 8,192 draws with
    speculation: Pearson's chi-square against the exactly enumerated target distribution
    stays under df + 5·sqrt(2·df) (a ~5-sigma bound), while a sampler that accepts every
    draft fails it by far."""
    model = serve_model(16, init_std=0.25)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    if method == "ngram":
        config, draft = SpeculativeConfig("ngram", 2, prompt_lookup_max=2), None
    else:
        config, draft = SpeculativeConfig("draft", 2), serve_model(16, n_layers=1, init_std=0.25)
    probs = exact_distribution(model, prompt, 4, temperature=1.0)
    counts = sampled_counts(engine(model, config, draft), prompt, 4, 1.0, 8192)
    statistic, df = chi_square(counts, probs)
    bound = df + 5 * (2 * df) ** 0.5
    assert statistic < bound, (statistic, df)

    monkeypatch.setattr(speculative, "_rejection_sample", always_accept)
    wrong = sampled_counts(engine(model, config, draft), prompt, 4, 1.0, 2048)
    assert chi_square(wrong, probs)[0] > 10 * bound


def test_rejection_sampler_residual_excludes_a_rejected_certain_draft():
    target = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    # the target gives the drafted token 0 no mass: always rejected, never re-drawn
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        emitted = speculative._rejection_sample(target, Draft([0]), generator)
        assert emitted == [1]


def test_speculative_configuration_errors_name_the_fix():
    model = serve_model(256)
    with pytest.raises(ConfigError, match="num_speculative_tokens=0"):
        SpeculativeConfig("draft", 0)
    with pytest.raises(ConfigError, match="method='eagle'"):
        SpeculativeConfig("eagle")
    with pytest.raises(RequestError, match="needs a draft model"):
        engine(model, SpeculativeConfig("draft", 2))
    with pytest.raises(RequestError, match="vocab_size 512 differs"):
        engine(model, SpeculativeConfig("draft", 2), serve_model(512))
    with pytest.raises(RequestError, match="not set to method 'draft'"):
        engine(model, SpeculativeConfig("ngram", 2), serve_model(256))


def test_draft_kv_shares_the_block_budget():
    model, draft = serve_model(256), serve_model(256, n_layers=1)
    alone = LLMEngine(model, config=EngineConfig(kv_cache_memory_mb=1.0))
    paired = LLMEngine(model, config=EngineConfig(kv_cache_memory_mb=1.0, speculative=(
        SpeculativeConfig("draft", 2))), draft_model=draft)
    blocks = len(paired.block_manager.blocks)
    # two target layers and one draft layer of the same width share each block's bytes
    assert blocks == pytest.approx(len(alone.block_manager.blocks) * 2 / 3, abs=1)
    assert paired.speculator.drafter.slabs.k[0].shape[0] == paired.slabs.k[0].shape[0]


def test_draws_are_counted_once_per_verified_step():
    model = serve_model(256)
    spec = engine(model, SpeculativeConfig("draft", 3), model)
    spec.generate([REPEATING[0]], SamplingParams(max_tokens=10, temperature=0))
    stats = spec.stats()
    # 10 = 1 (prefill) + 4 + 4 (two drafting steps: 3 accepted drafts + 1 each) + 1 (a
    # plain decode: drafting must leave room for the step's own token under max_tokens)
    assert stats["spec_decode_num_drafts"] == 2
    assert stats["spec_decode_num_accepted_tokens"] == 6


def test_server_with_a_draft_checkpoint_streams_the_plain_answer_and_reports_acceptance(
        checkpoint, client):
    spec_config = EngineConfig(num_blocks=128, speculative=SpeculativeConfig(
        "draft", 3, draft=checkpoint))
    server, thread, url = start_server(checkpoint, engine=spec_config)
    try:
        wait_healthy(url)
        spec_client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        request = {"model": "tiny", "prompt": "The river", "max_tokens": 12, "temperature": 0}
        streamed = "".join(chunk.choices[0].text for chunk in spec_client.completions.create(
            stream=True, **request))
        assert streamed == client.completions.create(**request).choices[0].text
        text = httpx.get(f"{url}/metrics").text
        assert 'lathe:spec_decode_acceptance_rate{model_name="tiny"} 1.0' in text
        for name in ("lathe:spec_decode_num_drafts_total",
                     "lathe:spec_decode_num_draft_tokens_total",
                     "lathe:spec_decode_num_accepted_tokens_total",
                     "lathe:spec_decode_mean_acceptance_length"):
            assert name in text, name
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_draft_with_another_tokenizer_is_refused(checkpoint, tmp_path):
    tokenizer = train_tokenizer([f"{i} other words entirely {i * 7}" for i in range(300)],
                                vocab_size=512, show_progress=False)
    save_tokenizer(tokenizer, tmp_path / "tokenizer")
    vocab = LLMEngine.from_checkpoint(checkpoint).model.config.vocab_size
    other = save_checkpoint(serve_model(vocab), tmp_path / "draft",
                            tokenizer=tmp_path / "tokenizer")
    config = EngineConfig(num_blocks=16, speculative=SpeculativeConfig("draft", 2, draft=other))
    with pytest.raises(CheckpointError, match="must share the target's tokenizer"):
        LLMEngine.from_checkpoint(checkpoint, config)


def test_serve_flags_for_speculation_are_checked_before_loading(checkpoint):
    from lathe.serve.commands import serve_main
    with pytest.raises(ConfigError, match="--speculative=draft needs --draft"):
        serve_main([str(checkpoint), "--speculative", "draft"])
    with pytest.raises(ConfigError, match="drop one of them"):
        serve_main([str(checkpoint), "--speculative", "ngram", "--draft", str(checkpoint)])
    with pytest.raises(ConfigError, match="--num-speculative-tokens=0"):
        serve_main([str(checkpoint), "--speculative", "ngram", "--num-speculative-tokens", "0"])


def test_serve_bench_speculative_section_reports_each_mode(checkpoint, capsys):
    from lathe.serve.bench import main
    assert main(["--checkpoint", str(checkpoint), "--draft", str(checkpoint), "--sections", "e",
                 "--spec-batches", "1", "2", "--spec-tokens", "8", "--no-write"]) == 0
    table = capsys.readouterr().out.split("### (e) Speculative decoding")[1].splitlines()
    # none, the draft and prompt lookup at each batch size
    assert [line.split(" | ")[1] for line in table if line.startswith("| 1 | ")] == [
        "none", "draft `ckpt`, k=4", "ngram (prompt lookup), k=4"]
    assert sum(line.startswith("| 2 | ") for line in table) == 3
    # the target drafting for itself accepts every draft; 8 tokens = 1 (prefill) + 5 + 2
    self_draft = next(line for line in table if line.startswith("| 1 | draft"))
    assert self_draft.endswith("| 100.0% | 3.50 |")
