"""A request's deltas between the engine core and its stream: a reader that falls behind
takes the deltas waiting for one sequence as one, and the tokens, text and log-probs it
reads add up to the same completion as a reader that keeps up."""

from __future__ import annotations

import asyncio

from lathe.serve.async_engine import AsyncEngine, DeltaQueue
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.outputs import SequenceDelta, TokenLogprob
from lathe.serve.request_checks import RequestError
from lathe.serve.sampling_params import SamplingParams


def delta(index: int, token: int, finish: str | None = None, request: str = "r",
          prompt_logprobs: list | None = None) -> SequenceDelta:
    return SequenceDelta(request, index, [token], f"<{token}>",
                         [TokenLogprob(token, -float(token), [])], finish, 5, 0,
                         prompt_logprobs)


def test_then_joins_the_same_sequence_until_it_ends():
    first = delta(0, 1, prompt_logprobs=[None])
    joined = first.then(delta(0, 2)).then(delta(0, 3, "length"))
    assert joined.token_ids == [1, 2, 3] and joined.text == "<1><2><3>"
    assert [lp.token_id for lp in joined.logprobs] == [1, 2, 3]
    assert joined.finish_reason == "length" and joined.prompt_logprobs == [None]
    assert first.token_ids == [1]  # the parts are left as they were
    assert first.then(delta(1, 2)) is None  # another of the request's n sequences
    assert first.then(delta(0, 2, request="other")) is None
    assert joined.then(delta(0, 4)) is None  # it ended
    assert delta(0, 1).then(delta(0, 2, prompt_logprobs=[None])) is None


def test_a_queue_read_late_gives_each_sequences_waiting_deltas_as_one():
    async def main() -> list:
        queue = DeltaQueue()
        error = RequestError("failed alone")
        for item in (delta(0, 1), delta(0, 2), delta(1, 7), delta(0, 3), delta(0, 4, "stop"),
                     delta(1, 8), error, delta(1, 10)):
            queue.put_nowait(item)
        read = [await queue.get() for _ in range(3)]
        read.append(await queue.get())
        waiter = asyncio.ensure_future(queue.get())
        await asyncio.sleep(0)
        assert not waiter.done()  # empty: get waits for the next put
        queue.put_nowait(delta(1, 9, "length"))
        return read + [await waiter]

    read = asyncio.run(main())
    # each sequence's waiting deltas as one, the other sequence's passed over in order
    assert [(d.index, d.token_ids, d.finish_reason) for d in read[:2]] == [
        (0, [1, 2, 3, 4], "stop"), (1, [7, 8], None)]
    assert isinstance(read[2], RequestError)  # nothing behind an error is read before it
    assert read[3].token_ids == [10]
    assert read[4].token_ids == [9] and read[4].finish_reason == "length"


def test_a_delta_that_does_not_join_keeps_the_order_of_what_follows():
    async def main() -> list:
        queue = DeltaQueue()
        for item in (delta(0, 1), delta(1, 7), delta(0, 2, prompt_logprobs=[None]),
                     delta(1, 8), delta(0, 3)):
            queue.put_nowait(item)
        return [await queue.get() for _ in range(3)]

    read = asyncio.run(main())
    assert [(d.index, d.token_ids) for d in read] == [(0, [1]), (1, [7, 8]), (0, [2, 3])]
    assert read[2].prompt_logprobs == [None]


async def read(engine: LLMEngine, prompt: list[int], params: SamplingParams,
               pause: float) -> list[SequenceDelta]:
    """A request's deltas through an `AsyncEngine`, read with `pause` seconds after each."""
    served = await AsyncEngine.launch(load=lambda: engine)
    deltas = []
    async for item in served.stream(prompt, params):
        deltas.append(item)
        await asyncio.sleep(pause)
    await served.stop()
    return deltas


def test_a_slow_reader_gets_fewer_events_and_the_same_completion(checkpoint):
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=64))
    prompt = engine.encode("The river flows past the old mill")
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=1, ignore_eos=True)
    want = engine.generate([prompt], params)[0].outputs[0]

    for pause in (0.0, 0.02):
        deltas = asyncio.run(read(engine, prompt, params, pause))
        assert [t for d in deltas for t in d.token_ids] == want.token_ids
        assert "".join(d.text for d in deltas) == want.text
        assert [lp.token_id for d in deltas for lp in d.logprobs] == want.token_ids
        assert deltas[-1].finish_reason == "length"
    assert len(deltas) < len(want.token_ids) // 2  # 20 ms a read: steps pile up between


def test_a_slow_reader_of_n_sequences_gets_each_ones_tokens_joined(checkpoint):
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=64))
    prompt = engine.encode("The river flows past the old mill")
    params = SamplingParams(n=3, max_tokens=30, temperature=1.0, seed=11, ignore_eos=True)
    want = [output.token_ids for output in engine.generate([prompt], params)[0].outputs]

    for pause in (0.0, 0.02):
        deltas = asyncio.run(read(engine, prompt, params, pause))
        assert [[t for d in deltas if d.index == i for t in d.token_ids]
                for i in range(3)] == want
        assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"] * 3
    assert len(want) == 3 and len(set(map(tuple, want))) > 1  # seeded: three samples
    assert len(deltas) < sum(map(len, want)) // 2
