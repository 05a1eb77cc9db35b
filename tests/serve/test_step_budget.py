"""The step budget (`EngineConfig.max_decode_stall`, `lathe.serve.scheduler.StepCost`): with
streams decoding, a step's prefill is held to the tokens that keep it within a multiple of a
decode-only step, estimated from the steps the engine times; greedy tokens stay those of
naive recompute; the setting is refused where it cannot mean anything."""

from __future__ import annotations

import pytest

from lathe.core.errors import ConfigError
from lathe.serve.commands import serve_main
from lathe.serve.config import EngineConfig
from lathe.serve.sampling_params import SamplingParams
from lathe.serve.scheduler import ScheduledBatch, StepCost
from tests.builders import serve_model
from tests.serve.test_engine import engine_for, naive_greedy, prompts


def batch(decodes: int, prefill: int) -> ScheduledBatch:
    """A scheduled step of `decodes` one-token rows and one `prefill`-token chunk (the
    estimate reads counts only)."""
    items = [(object(), 1) for _ in range(decodes)] + ([(object(), prefill)] if prefill else [])
    return ScheduledBatch(items, decodes=decodes)


def test_the_cap_is_what_keeps_a_step_within_the_stall_it_allows():
    cost = StepCost(max_stall=4, min_tokens=16)
    assert cost.prefill_cap() is None  # nothing timed yet
    cost.observe(batch(8, 0), 0.010)
    assert cost.prefill_cap() is None  # a token's cost not yet known
    cost.observe(batch(8, 8), 0.500)  # too few tokens to measure one: ignored
    assert cost.prefill_cap() is None
    cost.observe(batch(8, 100), 0.060)  # 50 ms over a decode step for 100 tokens
    assert cost.token_seconds == pytest.approx(0.0005)
    assert cost.prefill_cap() == 60  # 3 decode steps' 30 ms of prefill
    cost.observe(batch(8, 0), 0.020)  # decode steps grow slower: the average follows
    assert cost.decode_seconds == pytest.approx(0.012)
    assert cost.prefill_cap() == 72
    slow = StepCost(max_stall=4, min_tokens=16)  # a very slow prefill: never below min_tokens
    slow.observe(batch(8, 0), 0.010)
    slow.observe(batch(8, 100), 10.0)
    assert slow.prefill_cap() == 16
    off = StepCost(max_stall=0, min_tokens=16)
    off.observe(batch(8, 0), 0.010)
    off.observe(batch(8, 100), 0.060)
    assert off.prefill_cap() is None


def test_a_step_with_decodes_holds_its_prefill_to_the_cap():
    model = serve_model(256)
    engine = engine_for(model, max_num_batched_tokens=64, max_decode_stall=4)
    engine.step_cost.prefill_cap = lambda: 8
    steps = []
    schedule = engine.scheduler.schedule

    def recorded(prefill_cap=None):
        steps.append(schedule(prefill_cap))
        return steps[-1]
    engine.scheduler.schedule = recorded
    short, long = prompts([5, 6]), prompts([40], seed=1)[0]
    params = SamplingParams(max_tokens=12, temperature=0)
    for i, prompt in enumerate(short):
        engine.add_request(prompt, params, request_id=f"s{i}")
    outputs = {}
    for delta in engine.step():  # both prompts at once: no decodes yet, the whole budget
        outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert (steps[0].decodes, steps[0].prefill_tokens) == (0, 11)
    engine.add_request(long, params, request_id="long")
    while engine.has_unfinished():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
    during = [s for s in steps[1:] if s.decodes and s.prefill_tokens]
    assert during and all(s.prefill_tokens <= 8 for s in during)
    assert sum(s.prefill_tokens for s in steps[1:]) == 40
    for request_id, prompt in [("s0", short[0]), ("s1", short[1]), ("long", long)]:
        assert outputs[request_id] == naive_greedy(model, prompt, 12)


def test_the_engine_times_its_steps_and_keeps_its_tokens():
    # wide enough that a 64-token prefill costs clearly more than a decode step: on the
    # 2-layer default a step is Python's time, and under CI's load every prefill step once
    # timed no longer than the decodes' average
    model = serve_model(256, dim=256, n_heads=4, n_kv_heads=2, n_layers=4)
    params = SamplingParams(max_tokens=16, temperature=0)
    engine = engine_for(model, max_num_batched_tokens=64, max_decode_stall=2)
    # the first batch's last steps time a decode, the later ones' (new prompts: no prefix
    # hits) their prefill tokens — three batches of them, as one machine stall in a decode
    # step can outlast a whole batch's prefills under CI's load
    for seed in range(4):
        batch_prompts = prompts([3, 17, 40, 70, 1, 33], seed=seed)
        want = [r.outputs[0].token_ids for r in engine_for(model).generate(batch_prompts,
                                                                           params)]
        assert [r.outputs[0].token_ids for r in engine.generate(batch_prompts, params)] == want
    cost = engine.step_cost
    assert cost.decode_seconds > 0 and cost.token_seconds > 0
    assert cost.prefill_cap() >= engine.config.block_size


def test_max_decode_stall_is_refused_where_it_cannot_mean_anything(checkpoint):
    for value in (-1, 0.5, 1):
        with pytest.raises(ConfigError, match=f"max_decode_stall={value} must be 0"):
            EngineConfig(max_decode_stall=value)
    with pytest.raises(ConfigError, match="--max-decode-stall=1.0 must be 0 .off. or more"):
        serve_main([str(checkpoint), "--max-decode-stall", "1"])


def test_lathe_serve_bounds_the_stall_when_asked(checkpoint, monkeypatch):
    """Off by default (it costs first tokens and throughput), on with the flag."""
    import lathe.serve.server
    configs = []
    monkeypatch.setattr(lathe.serve.server, "run", lambda config: configs.append(config))
    serve_main([str(checkpoint), "--enforce-eager"])
    serve_main([str(checkpoint), "--enforce-eager", "--max-decode-stall", "4"])
    assert [c.engine.max_decode_stall for c in configs] == [0.0, 4.0]
