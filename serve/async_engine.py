"""Streaming access to one `LLMEngine` from asyncio code (the server, GRPO rollouts).

A single background task owns the engine: between steps it applies the requests added
and aborted since the last one, then runs `step()` on the engine thread (the forward pass
must not block the event loop, and all torch work stays on one thread: `EngineThread`) and
routes each `SequenceDelta` to its request's queue. No engine state is touched from two
threads at once, so the engine needs no locks.

Failures are kept to their scope. A request the engine refuses when it is added fails
alone: its stream raises the error. A failing `step()` leaves the engine's state unknown,
so the engine is *dead* (as vLLM's EngineDeadError): every open stream and every later
`submit` raises `EngineDead` at once, and the server's /health turns 503 — nothing hangs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

from lathe.serve.adapters import AdapterError
from lathe.serve.engine import LLMEngine, RequestError
from lathe.serve.engine_thread import EngineThread
from lathe.serve.outputs import SequenceDelta
from lathe.serve.sampling import SamplingParams

log = logging.getLogger("lathe.serve")


class QueueFull(RuntimeError):
    """More requests are waiting than the engine was configured to queue."""


class EngineDead(RuntimeError):
    """The engine loop failed; no request can be served until the process restarts."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256,
                 on_step: Callable[[list[SequenceDelta], float], None] | None = None,
                 thread: EngineThread | None = None) -> None:
        """`thread`: the one the engine was built on (the server's), else a new one."""
        self.engine = engine
        self.thread = thread or EngineThread()
        self.max_waiting = max_waiting
        self.on_step = on_step  # called with each step's deltas and its duration
        self._queues: dict[str, asyncio.Queue[SequenceDelta | BaseException]] = {}
        self._pending_adds: list[tuple[str, list[int], SamplingParams, str | None]] = []
        self._pending_aborts: list[str] = []
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self._task: asyncio.Task | None = None
        self.dead: EngineDead | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.thread.close()

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + len(self._pending_adds)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               request_id: str | None = None, adapter: str | None = None) -> str:
        """Queue a request, on the LoRA adapter named `adapter` if given, now (raising
        `EngineDead`, `RequestError`, `AdapterError` or `QueueFull` at once); read its
        deltas with `results`."""
        if self.dead is not None:
            raise self.dead
        self.engine.validate(prompt_ids, params)
        if adapter is not None and adapter not in self.adapter_names:
            raise AdapterError(f"no adapter named {adapter!r} is loaded")
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are already waiting "
                            f"(max_waiting={self.max_waiting}); retry later")
        request_id = request_id or f"async-{next(self._ids)}"
        self._queues[request_id] = asyncio.Queue()
        self._pending_adds.append((request_id, prompt_ids, params, adapter))
        self._wake.set()
        return request_id

    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters requests may name."""
        return self.engine.adapters.names if self.engine.adapters is not None else []

    async def add_adapter(self, name: str, path: str) -> None:
        """Load an adapter (read and checked off the event loop); running requests go on."""
        await self.thread.run(self.engine.add_adapter, name, path)

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter; requests already running on it finish on it."""
        self.engine.remove_adapter(name)

    def abort(self, request_id: str) -> None:
        """Abort a submitted request whose results nobody will read."""
        self._queues.pop(request_id, None)
        self._pending_aborts.append(request_id)
        self._wake.set()

    async def results(self, request_id: str, n: int) -> AsyncIterator[SequenceDelta]:
        """Deltas of the request's n sequences until all have finished. Leaving early (a
        client gone, a cancelled task) aborts the request and frees its blocks."""
        queue = self._queues[request_id]
        unfinished = n
        try:
            while unfinished:
                delta = await queue.get()
                if isinstance(delta, BaseException):
                    raise delta
                unfinished -= delta.finish_reason is not None
                yield delta
        finally:
            self._queues.pop(request_id, None)
            if unfinished:
                self._pending_aborts.append(request_id)
                self._wake.set()

    async def stream(self, prompt_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[SequenceDelta]:
        """`submit` and `results` in one call."""
        request_id = self.submit(prompt_ids, params)
        async for delta in self.results(request_id, params.n):
            yield delta

    async def _run(self) -> None:
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                start = time.perf_counter()
                deltas = await self.thread.run(self.engine.step)
                if self.on_step is not None:
                    self.on_step(deltas, time.perf_counter() - start)
                for delta in deltas:
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:  # a sequence that failed alone fails its request
                        queue.put_nowait(delta if delta.error is None
                                         else RequestError(delta.error))
        except Exception as error:  # fail every open stream and every later request
            self.dead = EngineDead(f"the engine failed and must be restarted: "
                                   f"{type(error).__name__}: {error}")
            self.dead.__cause__ = error
            log.exception("engine loop failed; failing every request from now on")
            for queue in self._queues.values():
                queue.put_nowait(self.dead)
            self._pending_adds.clear()

    def _apply_pending(self) -> None:
        aborts, self._pending_aborts = set(self._pending_aborts), []
        adds, self._pending_adds = self._pending_adds, []
        for request_id in aborts:
            self.engine.abort(request_id)
        for request_id, prompt_ids, params, adapter in adds:
            if request_id in aborts:
                continue
            try:
                self.engine.add_request(prompt_ids, params, request_id, adapter)
            except Exception as error:  # this request fails alone
                self.engine.abort(request_id)
                queue = self._queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(error)
