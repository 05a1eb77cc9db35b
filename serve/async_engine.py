"""Streaming access to one engine core (`lathe.serve.engine_core`) from asyncio code: the
server's front end.

`AsyncEngine.launch` starts the core — in a process of its own, or for `load` on a thread
of this process — and waits until it has loaded and warmed up. Requests are checked here
(`RequestLimits`, a structured output's grammar) so that a bad one fails at once, then sent
to the core; the core's `SequenceDelta`s are read off its pipe by the event loop itself
(`add_reader`: no thread between them) and routed to each request's `DeltaQueue`. A reader
that falls behind the engine takes the deltas waiting for one sequence as one (as vLLM's
output collector does), for each of a request's n sequences: a stream then sends one event
for several steps' tokens of a sequence instead of spending the event loop's time on an
event per token while the engine runs ahead.

Failures are kept to their scope. A request the core refuses when it is added fails
alone: its stream raises the error. A failed step, or a core that exits (a fatal signal,
the OOM killer), leaves the engine's state unknown, so the engine is *dead* (as vLLM's
EngineDeadError): every open stream and every later `submit` raises `EngineDead` at once,
and the server's /health turns 503 — nothing hangs. A server whose shutdown drain runs out
ends its open requests with `ServerClosing` (`end_requests`), so that streams close with an
error event rather than a cut connection.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing
import os
import threading
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from lathe.serve.core_messages import (
    Abort,
    AddRequest,
    Call,
    Close,
    Dead,
    Deltas,
    EngineSpec,
    Failed,
    ModelInfo,
    Ready,
    Rejected,
    Reply,
    Status,
    process_main,
)
from lathe.serve.outputs import SequenceDelta
from lathe.serve.request_checks import AdapterError, RequestError
from lathe.serve.sampling_params import SamplingParams
from lathe.serve.structured import (
    GrammarCompiler,
    StructuredOutput,
    compile_structured,
    grammar_compiler,
)

if TYPE_CHECKING:  # the front end imports no torch: only a `load` brings an engine
    from lathe.serve.engine import LLMEngine

log = logging.getLogger("lathe.serve")


class QueueFull(RuntimeError):
    """More requests are waiting than the engine was configured to queue."""


class EngineDead(RuntimeError):
    """The engine loop failed; no request can be served until the process restarts."""


class ServerClosing(RuntimeError):
    """The server is shutting down and its drain time is up: the request is ended."""


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
    """The front end's handle on one engine core: `launch` it, `submit` requests and read
    their `results`, load and unload adapters, read its `stats`."""

    def __init__(self, commands: Connection, events: Connection,
                 core: multiprocessing.process.BaseProcess | threading.Thread,
                 max_waiting: int, status: Callable[[str], None],
                 request_prefix: str = "async") -> None:
        self._commands, self._events, self._core = commands, events, core
        self.max_waiting = max_waiting
        self.request_prefix = request_prefix
        self._status = status
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[ModelInfo] = self._loop.create_future()
        self._queues: dict[str, DeltaQueue] = {}
        self._unstarted: set[str] = set()  # submitted, no output yet
        self._calls: dict[int, asyncio.Future[None]] = {}
        self._ids = itertools.count()
        self._adapters: dict[str, str] = {}
        self._grammars: GrammarCompiler | None = None
        self._closed = False
        self._failed = False  # the load failed (launch raises it)
        self.info: ModelInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.stats: dict[str, float] | None = None  # the core's last `LLMEngine.stats()`
        self.dead: EngineDead | None = None
        # called once when the engine dies while serving (a server exits on it)
        self.on_death: Callable[[EngineDead], None] | None = None
        self._loop.add_reader(events.fileno(), self._on_events)

    @classmethod
    async def launch(cls, spec: EngineSpec | None = None, *,
                     load: Callable[[], LLMEngine] | None = None,
                     loras: dict[str, Path] | None = None, max_waiting: int = 256,
                     status: Callable[[str], None] = lambda text: None,
                     request_prefix: str = "async") -> AsyncEngine:
        """Start an engine core and wait until it serves: on `spec` in a process of its own,
        or on a thread of this process with `load` (an engine built here: tests, embedding).
        `loras`: adapters to load at start (name -> folder); `status`: told what the start
        waits for; `request_prefix`: what its request ids start with (unique among the cores
        of one front end). Raises what the load raised (the core has then ended). The core's
        process is spawned, so a script that calls this needs `if __name__ == "__main__":`."""
        if (spec is None) == (load is None):
            raise TypeError("AsyncEngine.launch takes a spec or a load, one of them")
        loras = dict(loras or {})
        core_commands, commands = multiprocessing.Pipe(duplex=False)
        events, core_events = multiprocessing.Pipe(duplex=False)
        core: multiprocessing.process.BaseProcess | threading.Thread
        if spec is not None:
            # spawn: a fork would copy this process's OpenMP and CUDA state mid-flight
            core = multiprocessing.get_context("spawn").Process(
                target=process_main,
                args=(spec, loras, core_commands, core_events, os.getpid()),
                name="lathe-engine-core", daemon=True)
            core.start()
            core_commands.close()  # the core's ends are its own: its exit closes the pipe
            core_events.close()
        else:
            from lathe.serve.engine_core import serve_engine  # an engine here: torch is here
            core = threading.Thread(target=serve_engine,
                                    args=(load, loras, core_commands, core_events),
                                    name="lathe-engine", daemon=True)
            core.start()
        engine = cls(commands, events, core, max_waiting, status, request_prefix)
        try:
            engine.info = await engine._ready
        except BaseException:
            await engine.stop()
            raise
        engine._adapters = dict(engine.info.adapters)
        if engine.info.tokenizer is not None:
            engine.tokenizer = Tokenizer.from_str(engine.info.tokenizer)
        return engine

    @property
    def max_model_len(self) -> int:
        assert self.info is not None
        return self.info.limits.max_model_len

    @property
    def num_waiting(self) -> int:
        """Requests submitted that have had no output yet (waiting or in their prefill)."""
        return len(self._unstarted)

    @property
    def in_flight(self) -> int:
        """Requests submitted whose results are still open."""
        return len(self._queues)

    @property
    def adapter_names(self) -> list[str]:
        """The LoRA adapters requests may name."""
        return list(self._adapters)

    def adapter_path(self, name: str) -> str:
        return self._adapters[name]

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured-output grammars, compiled here to check a request before it is sent
        (the core compiles its own), each new one first in a child process, where a grammar
        that crashes llguidance costs that request alone."""
        if self._grammars is None:
            assert self.info is not None
            self._grammars = grammar_compiler(
                self.tokenizer, self.info.limits.vocab_size, self.info.eos_token_ids,
                checked=True)
        return self._grammars

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`text` as token ids; `add_special_tokens`: with what the tokenizer's post-processor
        adds (a BOS), as a completions prompt takes by default. Through `encode_batch`, which
        lets go of the GIL while it works (`encode` holds it: a 1 MB prompt tokenized in a
        thread still froze the event loop for half a second)."""
        if self.tokenizer is None:
            raise RequestError("this checkpoint has no tokenizer.json: send token ids, not text")
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestError` for a request the engine could never complete."""
        assert self.info is not None
        self.info.limits.check(prompt_ids, params)
        if params.structured is not None:
            compile_structured(self.grammars, params.structured)

    def compile(self, spec: StructuredOutput) -> None:
        """Compile a structured output (`GrammarError`, or `RequestError` where this
        checkpoint cannot have one); a thread may call it."""
        self.grammars.compile(spec)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               adapter: str | None = None) -> str:
        """Queue a request, on the LoRA adapter named `adapter` if given, now (raising
        `EngineDead`, `RequestError`, `AdapterError` or `QueueFull` at once); read its
        deltas with `results`."""
        return self.submit_all([prompt_ids], [params], adapter)[0]

    def submit_all(self, prompts: list[list[int]], params: list[SamplingParams],
                   adapter: str | None = None) -> list[str]:
        """Queue a request per prompt (a completions call's list of prompts), all of them or
        none: every one is checked here first — the one place a served request is checked;
        the core takes what this sends as checked."""
        if self.dead is not None:
            raise self.dead
        for prompt_ids, p in zip(prompts, params, strict=True):
            self.validate(prompt_ids, p)
        if adapter is not None and adapter not in self._adapters:
            raise AdapterError(f"no adapter named {adapter!r} is loaded")
        if self.num_waiting + len(prompts) > self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are already waiting "
                            f"(max_waiting={self.max_waiting}); retry later")
        request_ids = []
        for prompt_ids, p in zip(prompts, params, strict=True):
            request_id = f"{self.request_prefix}-{next(self._ids)}"
            self._send(AddRequest(request_id, prompt_ids, p, adapter))
            self._queues[request_id] = DeltaQueue()
            self._unstarted.add(request_id)
            request_ids.append(request_id)
        return request_ids

    async def add_adapter(self, name: str, path: str | Path) -> None:
        """Load an adapter (read and checked by the core, between steps); running requests
        go on. Those the core unloaded to make room (max_loaded_loras) are forgotten here."""
        loaded = await self._call("add_adapter", name, path)
        self._adapters = {held: self._adapters.get(held, str(path)) for held in loaded}

    async def remove_adapter(self, name: str) -> None:
        """Unload an adapter (between steps); requests already running on it finish on it."""
        await self._call("remove_adapter", name)
        self._adapters.pop(name, None)

    async def update_weights(self, path: str | Path) -> int:
        """Load new weights from a folder of safetensors shards: the core stops admitting
        requests, lets the running ones finish on the old weights, swaps, and admits again
        (nothing is dropped, and no request mixes two versions). Returns the version."""
        return await self._call("update_weights", str(path))

    def abort(self, request_id: str) -> None:
        """Abort a submitted request whose results nobody will read."""
        self._queues.pop(request_id, None)
        self._unstarted.discard(request_id)
        if self.dead is None and not self._closed:
            try:
                self._send(Abort(request_id))
            except EngineDead:  # nothing left to abort
                pass

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

    def end_requests(self, reason: str) -> None:
        """End every open request with `ServerClosing(reason)`: its stream raises it (and
        aborts the request), so each client is told why instead of having its connection
        cut."""
        error = ServerClosing(reason)
        for queue in self._queues.values():
            queue.put_nowait(error)

    async def stream(self, prompt_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[SequenceDelta]:
        """`submit` and `results` in one call."""
        request_id = self.submit(prompt_ids, params)
        async for delta in self.results(request_id, params.n):
            yield delta

    async def stop(self) -> None:
        """Stop the core (after the step under way) and wait for it to end."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._events.fileno())
        for future in self._calls.values():  # no reply will come
            if not future.done():
                future.set_exception(EngineDead("the engine has been stopped"))
        self._calls.clear()
        try:
            self._commands.send(Close())
        except OSError:
            pass
        self._commands.close()
        await asyncio.to_thread(self._join)
        self._events.close()

    def _join(self) -> None:
        process = isinstance(self._core, multiprocessing.process.BaseProcess)
        if process and self.info is None:  # still loading: it reads no message until ready
            self._core.kill()
        self._core.join(timeout=30)
        if process and self._core.is_alive():
            log.warning("the engine core did not stop within 30 s; killing it")
            self._core.kill()
            self._core.join(timeout=5)

    # the core's messages, read on the event loop -----------------------------------------

    def _send(self, message: object) -> None:
        if self._closed:
            raise EngineDead("the engine has been stopped")
        try:
            self._commands.send(message)
        except (OSError, ValueError):  # the core is gone (its exit is read next)
            self._lost()
            raise self.dead or EngineDead("the engine core is gone") from None

    async def _call(self, method: str, *args: object) -> object:
        if self.dead is not None:
            raise self.dead
        call_id = next(self._ids)
        future = self._calls[call_id] = self._loop.create_future()
        try:
            self._send(Call(call_id, method, args))
        except EngineDead:
            self._calls.pop(call_id, None)
            raise
        return await future

    def _on_events(self) -> None:
        try:
            while self._events.poll():
                self._handle(self._events.recv())
        except (EOFError, OSError):
            self._lost()

    def _handle(self, message: object) -> None:
        match message:
            case Deltas(deltas, stats):
                if stats is not None:
                    self.stats = stats
                for delta in deltas:
                    self._unstarted.discard(delta.request_id)
                    queue = self._queues.get(delta.request_id)
                    if queue is not None:  # a sequence that failed alone fails its request
                        queue.put_nowait(delta if delta.error is None
                                         else RequestError(delta.error))
            case Rejected(request_id, error):
                self._unstarted.discard(request_id)
                queue = self._queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(error)
            case Reply(call_id, error, result):
                future = self._calls.pop(call_id, None)
                if future is not None and not future.done():
                    if error is None:
                        future.set_result(result)
                    else:
                        future.set_exception(error)
            case Status(text):
                self._status(text)
            case Ready(info):
                self._ready.set_result(info)
            case Failed(error):
                self._failed = True
                if not self._ready.done():
                    self._ready.set_exception(error)
            case Dead(text):
                self._die(text)

    def _lost(self) -> None:
        """The core's pipe closed: it has ended, and not because it was told to."""
        if self._closed or self._failed or self.dead is not None:
            return
        if isinstance(self._core, multiprocessing.process.BaseProcess):
            self._core.join(timeout=1)
            code = self._core.exitcode
            how = (f"exit code {code}" if code is None or code >= 0
                   else f"signal {-code}: a crash, or the OOM killer")
            self._die(f"the engine core process ended ({how})")
        else:
            self._die("the engine core thread ended")

    def _die(self, reason: str) -> None:
        """Fail every open stream, call and later request."""
        self.dead = EngineDead(f"the engine failed and must be restarted: {reason}")
        if not self._closed:
            self._loop.remove_reader(self._events.fileno())
        if not self._ready.done():
            self._ready.set_exception(self.dead)
            return
        log.error("%s; failing every request from now on", self.dead)
        for queue in self._queues.values():
            queue.put_nowait(self.dead)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(self.dead)
        self._calls.clear()
        if self.on_death is not None:
            self.on_death(self.dead)
