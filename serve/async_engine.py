"""Streaming access to one `LLMEngine` from asyncio code (the server).

The engine lives on its `EngineThread`, which steps it back to back while it has work:
before each step it applies the requests added and aborted since the last one (handed over
in thread-safe queues), and after it posts the step's `SequenceDelta`s to the event loop,
which routes each to its request's `DeltaQueue`. Engine state is touched on the engine
thread only (the event loop reads counters), so the engine needs no locks. A reader that
falls behind the engine takes the deltas waiting for one sequence as one (as vLLM's output
collector does), for each of a request's n sequences: a stream then sends one event for
several steps' tokens of a sequence instead of spending the event loop's time on an event
per token while the engine runs ahead.

Failures are kept to their scope. A request the engine refuses when it is added fails
alone: its stream raises the error. A failing `step()` leaves the engine's state unknown,
so the engine is *dead* (as vLLM's EngineDeadError): every open stream and every later
`submit` raises `EngineDead` at once, and the server's /health turns 503 — nothing hangs.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
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


# a request handed to the engine thread: id, prompt, sampling, adapter
_Add = tuple[str, list[int], SamplingParams, str | None]


class DeltaQueue:
    """One request's deltas (or the error that ends it), posted on the event loop and read
    by its stream: `get` joins the deltas waiting for one sequence (`SequenceDelta.then`)."""

    def __init__(self) -> None:
        self._items: collections.deque[SequenceDelta | BaseException] = collections.deque()
        self._ready = asyncio.Event()

    def put_nowait(self, item: SequenceDelta | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    async def get(self) -> SequenceDelta | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        return self._joined(item) if isinstance(item, SequenceDelta) else item

    def _joined(self, item: SequenceDelta) -> SequenceDelta:
        """`item` and the later deltas of its sequence that wait behind it, as one: the
        request's other sequences' deltas keep their order and their places ahead of what
        is left; the scan ends at an error (nothing behind one is read before it) or at the
        first delta of the sequence that does not join (`SequenceDelta.then`)."""
        passed: list[SequenceDelta] = []
        while self._items and isinstance(self._items[0], SequenceDelta):
            later = self._items.popleft()
            if (later.request_id, later.index) != (item.request_id, item.index):
                passed.append(later)
                continue
            joined = item.then(later)
            if joined is None:
                self._items.appendleft(later)
                break
            item = joined
        self._items.extendleft(reversed(passed))
        return item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256,
                 thread: EngineThread | None = None) -> None:
        """`thread`: the one the engine was built on (the server's), else a new one."""
        self.engine = engine
        self.thread = thread or EngineThread()
        self.max_waiting = max_waiting
        self._queues: dict[str, DeltaQueue] = {}
        # deques: appended on the event loop, taken on the engine thread
        self._pending_adds: collections.deque[_Add] = collections.deque()
        self._pending_aborts: collections.deque[str] = collections.deque()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dead: EngineDead | None = None

    def start(self) -> None:
        """Start stepping (call on the event loop that reads the results)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self.thread.set_stepper(self._step)

    async def stop(self) -> None:
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
        self._queues[request_id] = DeltaQueue()
        self._pending_adds.append((request_id, prompt_ids, params, adapter))
        self.thread.wake()
        return request_id

    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters requests may name."""
        return self.engine.adapters.names if self.engine.adapters is not None else []

    async def add_adapter(self, name: str, path: str) -> None:
        """Load an adapter (read and checked on the engine thread, between steps); running
        requests go on."""
        await self.thread.run(self.engine.add_adapter, name, path)

    async def remove_adapter(self, name: str) -> None:
        """Unload an adapter (between steps); requests already running on it finish on it."""
        await self.thread.run(self.engine.remove_adapter, name)

    def abort(self, request_id: str) -> None:
        """Abort a submitted request whose results nobody will read."""
        self._queues.pop(request_id, None)
        self._pending_aborts.append(request_id)
        self.thread.wake()

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
            if unfinished:
                self.abort(request_id)
            else:
                self._queues.pop(request_id, None)

    async def stream(self, prompt_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[SequenceDelta]:
        """`submit` and `results` in one call."""
        request_id = self.submit(prompt_ids, params)
        async for delta in self.results(request_id, params.n):
            yield delta

    # on the engine thread ---------------------------------------------------------------

    def _step(self) -> bool:
        """Apply what arrived, run one step and post its deltas to the event loop: whether
        the engine has work left."""
        try:
            self._apply_pending()
            if not self.engine.has_unfinished():
                return False
            deltas = self.engine.step()
        except Exception as error:  # the engine's state is unknown: fail everything
            self.thread.set_stepper(None)
            self._post(self._die, error)
            return False
        if deltas:
            self._post(self._route, deltas)
        return True

    def _apply_pending(self) -> None:
        aborts = set()
        while self._pending_aborts:
            aborts.add(self._pending_aborts.popleft())
        for request_id in aborts:
            self.engine.abort(request_id)
        while self._pending_adds:
            request_id, prompt_ids, params, adapter = self._pending_adds.popleft()
            if request_id in aborts:
                continue
            try:
                self.engine.add_request(prompt_ids, params, request_id, adapter)
            except Exception as error:  # this request fails alone
                self.engine.abort(request_id)
                self._post(self._route_error, request_id, error)

    def _post(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop has closed: nobody is left to tell
            pass

    # on the event loop ------------------------------------------------------------------

    def _route(self, deltas: list[SequenceDelta]) -> None:
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:  # a sequence that failed alone fails its request
                queue.put_nowait(delta if delta.error is None else RequestError(delta.error))

    def _route_error(self, request_id: str, error: Exception) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _die(self, error: Exception) -> None:
        """Fail every open stream and every later request."""
        self.dead = EngineDead(f"the engine failed and must be restarted: "
                               f"{type(error).__name__}: {error}")
        self.dead.__cause__ = error
        log.error("engine loop failed; failing every request from now on",
                  exc_info=(type(error), error, error.__traceback__))
        for queue in self._queues.values():
            queue.put_nowait(self.dead)
        self._pending_adds.clear()
