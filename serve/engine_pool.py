"""Data parallelism (vLLM's `--data-parallel-size`): several engine cores behind one front
end, each a whole replica of the model in a process of its own — on a GPU of its own where
the machine has one for each (`engine_core.place_replica`), else sharing the CPU's threads.

A request goes whole (its n sequences together) to the core with the fewest requests in
flight, the first of them on a tie; the core is read back off its request id's prefix, so
the pool keeps no table of its own. What changes the model — loading or unloading an adapter,
new weights — goes to every core, and answers once all have done it. The pool answers the
front end as one `AsyncEngine` does: the tokenizer, limits and grammars are the first
core's (every core loaded the same checkpoint), the counters of /metrics are the cores'
summed (a cache's usage averaged), and the death of any core is the pool's.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from tokenizers import Tokenizer

from lathe.serve.async_engine import AsyncEngine, EngineDead
from lathe.serve.core_messages import EngineSpec, ModelInfo
from lathe.serve.outputs import SequenceDelta
from lathe.serve.sampling_params import SamplingParams
from lathe.serve.structured import GrammarCompiler, StructuredOutput

AVERAGED = ("kv_cache_usage",)  # a fraction of each core's own cache, not a count


class EnginePool:
    """The front end's handle on `replicas` engine cores, answering as one `AsyncEngine`."""

    def __init__(self, cores: list[AsyncEngine]) -> None:
        self.cores = cores
        self._by_prefix = {core.request_prefix: core for core in cores}
        self.dead: EngineDead | None = None
        self.on_death: Callable[[EngineDead], None] | None = None
        for core in cores:
            core.on_death = self._died

    @classmethod
    async def launch(cls, spec: EngineSpec, replicas: int, *,
                     loras: dict[str, Path] | None = None, max_waiting: int = 256,
                     status: Callable[[str], None] = lambda text: None) -> EnginePool:
        """Start `replicas` cores on `spec` at once and wait until all serve; if one fails
        to load, the others are stopped and its error raised."""
        starts = [AsyncEngine.launch(dataclasses.replace(spec, replica=i, replicas=replicas),
                                     loras=loras, max_waiting=max_waiting,
                                     status=lambda text, i=i: status(f"engine core {i}: {text}"),
                                     request_prefix=f"dp{i}")
                  for i in range(replicas)]
        started = await asyncio.gather(*starts, return_exceptions=True)
        failed = [result for result in started if isinstance(result, BaseException)]
        if failed:
            await asyncio.gather(*(core.stop() for core in started
                                   if isinstance(core, AsyncEngine)))
            raise failed[0]
        return cls(started)

    # what every core shares: the first one's ---------------------------------------------

    @property
    def info(self) -> ModelInfo | None:
        return self.cores[0].info

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.cores[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return self.cores[0].max_model_len

    @property
    def adapter_names(self) -> list[str]:
        return self.cores[0].adapter_names

    def adapter_path(self, name: str) -> str:
        return self.cores[0].adapter_path(name)

    @property
    def grammars(self) -> GrammarCompiler:
        return self.cores[0].grammars

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.cores[0].encode(text, add_special_tokens)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.cores[0].validate(prompt_ids, params)

    def compile(self, spec: StructuredOutput) -> None:
        self.cores[0].compile(spec)

    # requests: each on one core ----------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return sum(core.num_waiting for core in self.cores)

    @property
    def stats(self) -> dict[str, float] | None:
        """The cores' last counters, summed (`AVERAGED` ones averaged); None until every
        core has reported."""
        reports = [core.stats for core in self.cores]
        if any(report is None for report in reports):
            return None
        keys = set().union(*reports)
        return {key: sum(report.get(key, 0) for report in reports)
                / (len(reports) if key in AVERAGED else 1) for key in keys}

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               adapter: str | None = None) -> str:
        return self.submit_all([prompt_ids], [params], adapter)[0]

    def submit_all(self, prompts: list[list[int]], params: list[SamplingParams],
                   adapter: str | None = None) -> list[str]:
        """Queue the prompts on the core with the fewest requests in flight."""
        if self.dead is not None:
            raise self.dead
        core = min(self.cores, key=lambda core: core.in_flight)
        return core.submit_all(prompts, params, adapter)

    def _owner(self, request_id: str) -> AsyncEngine:
        return self._by_prefix[request_id.rsplit("-", 1)[0]]

    def abort(self, request_id: str) -> None:
        self._owner(request_id).abort(request_id)

    def results(self, request_id: str, n: int) -> AsyncIterator[SequenceDelta]:
        return self._owner(request_id).results(request_id, n)

    async def stream(self, prompt_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[SequenceDelta]:
        request_id = self.submit(prompt_ids, params)
        async for delta in self.results(request_id, params.n):
            yield delta

    def end_requests(self, reason: str) -> None:
        for core in self.cores:
            core.end_requests(reason)

    # the model: on every core ------------------------------------------------------------

    async def add_adapter(self, name: str, path: str | Path) -> None:
        await asyncio.gather(*(core.add_adapter(name, path) for core in self.cores))

    async def remove_adapter(self, name: str) -> None:
        await asyncio.gather(*(core.remove_adapter(name) for core in self.cores))

    async def update_weights(self, path: str | Path) -> int:
        """New weights on every core (each drains, swaps and admits again on its own);
        the version, which every core counts alike."""
        versions = await asyncio.gather(*(core.update_weights(path) for core in self.cores))
        return versions[0]

    async def stop(self) -> None:
        await asyncio.gather(*(core.stop() for core in self.cores))

    def _died(self, error: EngineDead) -> None:
        if self.dead is None:
            self.dead = error
            if self.on_death is not None:
                self.on_death(error)


Engine = AsyncEngine | EnginePool  # what the front end serves from: one core, or a pool
