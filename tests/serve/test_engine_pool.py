"""Data parallelism: two engine cores behind one front end generate what one engine does,
requests spread over both; a weight push reaches both; the death of either is the pool's;
a server of two cores answers as one; each core's device follows its replica index."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import httpx
import openai
import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.serve.async_engine import EngineDead
from lathe.serve.config import EngineConfig, ServerConfig
from lathe.serve.core_messages import EngineSpec
from lathe.serve.engine import LLMEngine
from lathe.serve.engine_core import place_replica
from lathe.serve.engine_pool import EnginePool
from lathe.serve.sampling_params import SamplingParams
from lathe.serve.server import build_app
from tests.serve.conftest import API_KEY, served
from tests.serve.test_update_weights import PROMPT, greedy, pushed  # noqa: F401 - a fixture

CONFIG = EngineConfig(num_blocks=64)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


async def collect(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t async for delta in engine.stream(prompt, params) for t in delta.token_ids]


def test_two_cores_generate_what_one_engine_does_each_serving_a_share(checkpoint):
    offline = LLMEngine.from_checkpoint(checkpoint, CONFIG)
    prompts = [offline.encode(text) for text in ("The river flows", "A cat sat on", "Why",
                                                 "Once upon a time")]
    want = [r.outputs[0].token_ids for r in offline.generate(prompts, GREEDY)]
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2)
    want_sampled = sorted(o.token_ids for o in offline.generate([prompts[0]], sampled)[0].outputs)
    deaths: list[EngineDead] = []

    async def main() -> None:
        pool = await EnginePool.launch(EngineSpec(checkpoint, CONFIG), 2)
        pool.on_death = deaths.append
        pids = {core._core.pid for core in pool.cores}
        assert len(pids) == 2 and os.getpid() not in pids
        assert await asyncio.gather(*(collect(pool, p, GREEDY) for p in prompts)) == want
        served = [core.stats["generation_tokens"] for core in pool.cores]
        assert all(served) and sum(served) == 4 * 16  # both cores took a share
        assert pool.stats["generation_tokens"] == 4 * 16
        assert pool.stats["kv_cache_usage"] == 0  # averaged over the cores
        request = pool.submit(prompts[0], sampled)
        assert request.startswith(("dp0-", "dp1-"))
        by_index: dict[int, list[int]] = {0: [], 1: []}
        async for delta in pool.results(request, 2):
            by_index[delta.index] += delta.token_ids
        assert sorted(by_index.values()) == want_sampled  # a request's n stay on one core
        stream = pool.stream(prompts[1], SamplingParams(max_tokens=200, ignore_eos=True))
        await anext(stream)
        await stream.aclose()  # leaving early aborts it on its own core
        for _ in range(200):
            if all(core.stats["num_running"] == 0 for core in pool.cores):
                break
            await asyncio.sleep(0.05)
        assert all(core.stats["num_running"] == 0 for core in pool.cores)
        os.kill(pool.cores[1]._core.pid, signal.SIGKILL)
        for _ in range(200):
            if pool.dead is not None:
                break
            await asyncio.sleep(0.05)
        assert pool.dead is not None and deaths == [pool.dead]
        with pytest.raises(EngineDead):
            pool.submit(prompts[0], GREEDY)
        await pool.stop()
    asyncio.run(main())


def test_a_server_of_two_cores_answers_as_one_and_a_push_reaches_both(checkpoint,
                                                                       pushed):  # noqa: F811
    root, old, new = pushed
    with served(checkpoint, api_key=API_KEY, weight_roots=[root], data_parallel_size=2,
                engine=EngineConfig(num_blocks=128)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        prompt = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1,
                                           extra_body={"return_token_ids": True}
                                           ).choices[0].model_extra["prompt_token_ids"]

        def concurrently(count: int) -> list[list[int]]:
            results: list[list[int]] = [[] for _ in range(count)]

            def complete(i: int) -> None:
                results[i] = client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                    extra_body={"return_token_ids": True, "ignore_eos": True}
                ).choices[0].model_extra["token_ids"]
            threads = [threading.Thread(target=complete, args=(i,)) for i in range(count)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            return results

        assert concurrently(4) == [greedy(old, prompt, 16)] * 4
        metrics = httpx.get(f"{url}/metrics").text
        assert 'lathe:generation_tokens_total{model_name="tiny"} 65.0' in metrics
        push = httpx.post(f"{url}/update_weights", json={"path": str(root / "step-1")},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
        assert push.status_code == 200 and push.json()["weight_version"] == 1, push.text
        assert concurrently(4) == [greedy(new, prompt, 16)] * 4  # whichever core answers


def test_a_pool_is_built_from_the_checkpoint_only(checkpoint):
    with pytest.raises(ConfigError, match="data_parallel_size=0 must be >= 1"):
        ServerConfig(checkpoint=checkpoint, data_parallel_size=0)
    with pytest.raises(ConfigError, match="a process with a whole model"):
        ServerConfig(checkpoint=checkpoint, data_parallel_size=(os.cpu_count() or 1) + 1)
    config = ServerConfig(checkpoint=checkpoint, data_parallel_size=2)
    with pytest.raises(ConfigError, match="an engine built in this process"):
        build_app(config, load=lambda: LLMEngine.from_checkpoint(checkpoint, CONFIG))


def test_each_replica_takes_its_own_gpu_or_a_share_of_the_cpu(monkeypatch):
    """GPU i for replica i where there is one for each (torch's current device); fewer GPUs
    than replicas is refused naming both; on a CPU the replicas split its threads."""
    chosen, threads = [], []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    place_replica(3, 4, None)
    assert chosen == [3] and threads == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="data_parallel_size=4 .* sees 2"):
        place_replica(0, 4, None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    place_replica(1, 2, None)
    place_replica(0, 3, None)
    place_replica(0, 2, 5)  # --engine-threads decides
    place_replica(0, 1, None)  # one core: nothing to place
    assert threads == [4, 2] and chosen == [3]
