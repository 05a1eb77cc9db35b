"""The engine core in a process of its own: it streams what the engine generates, reports
its state, takes adapter calls and stops when told; a load that fails raises its own error
in the front end; a core that dies (SIGKILL) fails every open stream and later request at
once; a front end that vanishes takes its core with it (the pipe closes)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lathe.model.checkpoint import CheckpointError
from lathe.serve.async_engine import AsyncEngine, EngineDead
from lathe.serve.config import EngineConfig
from lathe.serve.core_messages import EngineSpec
from lathe.serve.engine import LLMEngine
from lathe.serve.engine_core import SMALL_WEIGHTS, engine_threads
from lathe.serve.request_checks import AdapterError, RequestError
from lathe.serve.sampling_params import SamplingParams

CONFIG = EngineConfig(num_blocks=64)


def launch(checkpoint, config: EngineConfig = CONFIG) -> AsyncEngine:
    return AsyncEngine.launch(EngineSpec(checkpoint, config))


async def collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t async for delta in engine.stream(prompt, params) for t in delta.token_ids]


def test_a_core_process_streams_what_the_engine_generates_and_stops(checkpoint):
    offline = LLMEngine.from_checkpoint(checkpoint, CONFIG)
    prompts = [offline.encode(text) for text in ("The river flows", "A cat sat on", "Why")]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=5, n=2)
    want = [r.outputs[0].token_ids for r in offline.generate(prompts, greedy)]
    want_sampled = [o.token_ids for o in offline.generate([prompts[0]], sampled)[0].outputs]

    async def main() -> None:
        engine = await launch(checkpoint)
        core = engine._core
        assert core.pid != os.getpid() and core.is_alive()
        got = await asyncio.gather(*(collect(engine, p, greedy) for p in prompts))
        assert got == want  # concurrent requests, batched in the core
        request = engine.submit(prompts[0], sampled)
        by_index: dict[int, list[int]] = {0: [], 1: []}
        async for delta in engine.results(request, 2):
            by_index[delta.index] += delta.token_ids
        assert [by_index[0], by_index[1]] == want_sampled
        assert engine.stats["generation_tokens"] == 3 * 24 + sum(map(len, want_sampled))
        assert engine.stats["num_running"] == 0 and engine.stats["kv_cache_usage"] == 0
        with pytest.raises(RequestError, match="maximum context length"):
            engine.submit(prompts[0], SamplingParams(max_tokens=10**6))
        with pytest.raises(AdapterError, match="serves no adapters"):
            await engine.add_adapter("x", checkpoint)  # refused in the core, raised here
        await engine.stop()
        assert core.exitcode == 0
    asyncio.run(main())


def test_a_load_that_fails_in_the_core_raises_its_error_here(tmp_path):
    async def main() -> None:
        with pytest.raises(CheckpointError, match="config.json"):
            await launch(tmp_path)
    asyncio.run(main())


def test_a_killed_core_fails_open_streams_and_later_requests_at_once(checkpoint):
    async def main() -> None:
        engine = await launch(checkpoint)
        prompt = engine.encode("The river flows")
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        stream = engine.stream(prompt, long)
        await anext(stream)
        os.kill(engine._core.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDead, match="signal 9"):
            async for _ in stream:
                pass
        assert time.monotonic() - started < 10
        with pytest.raises(EngineDead):
            engine.submit(prompt, long)
        with pytest.raises(EngineDead):
            await engine.remove_adapter("x")
        await engine.stop()
    asyncio.run(main())


def test_a_core_whose_front_end_is_gone_ends(checkpoint):
    async def main() -> None:
        engine = await launch(checkpoint)
        core = engine._core
        engine._commands.close()  # as the front end's death closes it: no Close sent
        await asyncio.to_thread(core.join, 30)
        assert core.exitcode == 0
        await engine.stop()
    asyncio.run(main())


def test_a_small_model_leaves_the_front_end_a_core_unless_told(checkpoint, monkeypatch):
    engine = LLMEngine.from_checkpoint(checkpoint, CONFIG)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert engine.memory["weight_bytes"] < SMALL_WEIGHTS
    assert engine_threads(engine, None) == 3
    assert engine_threads(engine, 4) == 4  # --engine-threads wins
    monkeypatch.setitem(engine.memory, "weight_bytes", SMALL_WEIGHTS)
    assert engine_threads(engine, None) == 4  # a step that reads its weights takes them all
    monkeypatch.setitem(engine.memory, "weight_bytes", 0)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert engine_threads(engine, None) == 4  # the user's choice stands
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert engine_threads(engine, None) == 1


def test_the_core_process_computes_on_the_threads_asked(checkpoint):
    async def main() -> int:
        engine = await AsyncEngine.launch(EngineSpec(checkpoint, CONFIG, threads=2))
        await engine.stop()
        return engine.info.threads
    assert asyncio.run(main()) == 2  # a model this small would get one fewer by default


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_front_end_killed_while_its_core_loads_leaves_no_core_behind(checkpoint):
    front_end = textwrap.dedent(f"""
        import asyncio, multiprocessing
        from lathe.serve.async_engine import AsyncEngine
        from lathe.serve.core_messages import EngineSpec

        async def main():
            asyncio.ensure_future(AsyncEngine.launch(EngineSpec({str(checkpoint)!r})))
            while not multiprocessing.active_children():
                await asyncio.sleep(0.01)
            print(multiprocessing.active_children()[0].pid, flush=True)
            await asyncio.sleep(60)

        if __name__ == "__main__":
            asyncio.run(main())
    """)
    process = subprocess.Popen([sys.executable, "-c", front_end], stdout=subprocess.PIPE,
                               text=True)
    core = int(process.stdout.readline())
    process.kill()
    process.wait()
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{core}") and "Z" not in _state(core):
        assert time.monotonic() < deadline, "the core outlived its front end"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"


def test_a_server_whose_core_dies_exits_non_zero(checkpoint):
    """`lathe serve` after its engine core is killed: every request would be a 503, so it
    exits (non-zero, saying why) for its supervisor to restart it, instead of answering
    503 forever."""
    import subprocess

    from tests.serve.test_connections import serve_process

    process, url = serve_process(checkpoint, "--enforce-eager")
    try:
        cores = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True,
                               text=True).stdout.split()
        assert cores, "no engine core process"
        for pid in cores:
            os.kill(int(pid), signal.SIGKILL)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode not in (0, None), output
    assert "the engine failed and must be restarted" in output
