"""The engine core: one `LLMEngine` stepped back to back by the one thread that does all
of its torch work, fed and read through a pair of pipes — by default in a process of its
own beside the HTTP server, as vLLM's engine core runs beside its API server.

Why a process: the server's front end (HTTP, JSON, each stream's events) and the engine's
step are both Python, and in one process they take turns on the GIL, so every token paid
for both in series. On the README model (a step of ~0.5 ms) one stream lost ~0.5 ms a token
to the front end's share and to the hand-overs (py-spy: the engine thread waiting to retake
the GIL after waking the event loop). In a process of its own the engine steps while the
front end streams the last step's tokens. A core that dies (a fatal signal, the OOM killer)
takes no HTTP connection down with it: the front end sees its pipe close and fails every
stream with `EngineDead`.

Why one thread does the engine's torch work (loading, adapters, steps): each thread that
enters an ATen parallel region gets an OpenMP team of its own, and on a CPU two teams
contend for the same cores even when one is idle (88M model, int8: steps on a thread other
than the one that built the model ran at ~1.55 CPU-seconds per wall second and 20–25%
slower; built and stepped on one thread, 2.0). A second thread here only reads the pipe.

The messages and what crosses the pipes are `lathe.serve.core_messages`'.
The core ends at `Close` or when the front end's pipe closes (the front end gone, however
it went); a core in a process of its own ignores SIGINT (a terminal's Ctrl-C reaches the
whole process group) and is stopped by its front end.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from lathe.core.errors import ConfigError, LatheError
from lathe.kernels.cpu_native import build_status
from lathe.serve.core_messages import (
    CALLS,
    IDLE_CALLS,
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
    freeze_startup_heap,
    portable,
)
from lathe.serve.engine import LLMEngine
from lathe.serve.quant import WEIGHT_DTYPES

log = logging.getLogger("lathe.serve")

STATS_SECONDS = 0.05  # how stale the front end's /metrics may be while the engine is busy
STATUS_SECONDS = 0.5  # how often a loading core reports what it waits for
# below this many bytes of weights a CPU decode step is mostly CPython, not weight reads
# (~1.6 ms of them at ~20 GB/s, against ~0.3 ms of the front end's own work per token)
SMALL_WEIGHTS = 32 * 2**20
def load_engine(spec: EngineSpec) -> LLMEngine:
    """The engine `spec` describes, on this process's intra-op threads (`engine_threads`),
    on its replica's device (`place_replica`)."""
    place_replica(spec.replica, spec.replicas, spec.threads)
    engine = LLMEngine.from_checkpoint(spec.checkpoint, spec.config, quantize=spec.quantize,
                                       dtype=WEIGHT_DTYPES[spec.dtype])
    torch.set_num_threads(engine_threads(engine, spec.threads))
    return engine


def place_replica(replica: int, replicas: int, threads: int | None) -> None:
    """Put data-parallel core `replica` of `replicas` on its device before it loads: on a
    machine with a GPU for each, GPU `replica` becomes this process's current device (which
    every allocation, kernel and captured graph then takes); on a CPU the cores share its
    threads, `replicas` ways (unless `threads` says). Fewer GPUs than replicas is a
    ConfigError naming both numbers."""
    if replicas == 1:
        return
    gpus = torch.cuda.device_count()
    if gpus == 0:
        if threads is None:
            torch.set_num_threads(max(1, torch.get_num_threads() // replicas))
        return
    if gpus < replicas:
        raise ConfigError(f"data_parallel_size={replicas} puts each engine core on a GPU of "
                          f"its own, and this process sees {gpus}; lower it to {gpus} or "
                          "make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    torch.cuda.set_device(replica)


def serve_spec(spec: EngineSpec, loras: dict[str, Path], commands: Connection,
               events: Connection) -> None:
    """`serve_engine` on the engine `spec` describes (a core's process)."""
    serve_engine(lambda: load_engine(spec), loras, commands, events)


def engine_threads(engine: LLMEngine, asked: int | None) -> int:
    """The intra-op threads of a core in a process of its own: `asked`, else torch's
    (its cores, or OMP_NUM_THREADS) — but one fewer on a CPU when the model's weights are
    small, so that the front end keeps a core. A small model's step is mostly CPython, which
    a second thread hardly shortens, while that thread's spinning takes the core the front
    end streams on: on 2 cores the README model (5 MB) served 12-26% more tokens a second to
    one stream and 29-34% more to 16 on one thread than on two, the 88M one (352 MB) half
    as many."""
    if asked is not None:
        return asked
    threads = torch.get_num_threads()
    if engine.device.type != "cpu" or "OMP_NUM_THREADS" in os.environ or threads < 2:
        return threads
    return threads - 1 if engine.memory["weight_bytes"] < SMALL_WEIGHTS else threads


class EngineCore:
    """The loop: apply what the front end sent, step while there is work, post the output."""

    def __init__(self, engine: LLMEngine, send: Callable[[object], None]) -> None:
        self.engine = engine
        self.send = send
        self.inbox: collections.deque[object] = collections.deque()
        self._inbox_lock = threading.Lock()  # the reader appends while a pause sorts it
        self.wake = threading.Event()
        self._stats_at = 0.0
        self._stale = False  # the front end's stats predate what happened since

    def poke(self) -> None:
        """Have the loop send the front end fresh stats, idle or not (a compiled step built
        in the background changed them)."""
        self._stale = True
        self.wake.set()

    def read(self, commands: Connection) -> None:
        """Take the front end's messages as they come (a thread of their own: the core never
        stops reading, so neither side can block the other on a full pipe)."""
        def reader() -> None:
            while True:
                try:
                    message = commands.recv()
                except (EOFError, OSError):  # the front end is gone
                    message = Close()
                with self._inbox_lock:
                    self.inbox.append(message)
                self.wake.set()
                if isinstance(message, Close):
                    return
        threading.Thread(target=reader, name="lathe-engine-inbox", daemon=True).start()

    def run(self) -> None:
        """Until `Close`, or a step fails (posted as `Dead`)."""
        while True:
            self.wake.clear()  # before looking for work: a message after this wakes the wait
            while self.inbox:
                if self._paused():
                    if not self._apply_aborts():
                        return
                    break
                if not self._apply(self.inbox.popleft()):
                    return
            if not self.engine.has_unfinished():
                if self._stale:
                    self._stale = False
                    self.send(Deltas([], self.engine.stats()))
                self.wake.wait()
                continue
            try:
                deltas = self.engine.step()
            except Exception as error:
                log.exception("an engine step failed; the engine core stops")
                self.send(Dead(f"{type(error).__name__}: {error}"))
                return
            self._stale = True
            now = time.monotonic()
            stats = None
            if now - self._stats_at >= STATS_SECONDS or not self.engine.has_unfinished():
                stats, self._stats_at = self.engine.stats(), now
            if deltas or stats is not None:
                self.send(Deltas(deltas, stats))

    def _paused(self) -> bool:
        """Whether the next message waits for the running requests to finish."""
        message = self.inbox[0]
        return (isinstance(message, Call) and message.method in IDLE_CALLS
                and self.engine.has_unfinished())

    def _apply_aborts(self) -> bool:
        """While admission is paused, what cannot wait: aborts (a client gone) and `Close`,
        taken out of the queue; False at `Close`."""
        with self._inbox_lock:
            urgent = [m for m in self.inbox if isinstance(m, Abort | Close)]
            held = [m for m in self.inbox if not isinstance(m, Abort | Close)]
            self.inbox.clear()
            self.inbox.extend(held)
        return all(self._apply(message) for message in urgent)

    def _apply(self, message: object) -> bool:
        """One message from the front end; False at `Close`."""
        self._stale = True
        match message:
            case AddRequest(request_id, prompt_ids, params, adapter):
                try:
                    self.engine.add_request(prompt_ids, params, request_id, adapter,
                                            checked=True)
                except Exception as error:  # this request fails alone
                    self.engine.abort(request_id)
                    self.send(Rejected(request_id, portable(error)))
            case Abort(request_id):
                self.engine.abort(request_id)
            case Call(call_id, method, args):
                try:
                    if method not in CALLS:
                        raise ValueError(f"the engine core takes no call {method!r}")
                    result = getattr(self.engine, method)(*args)
                except Exception as error:
                    self.send(Reply(call_id, portable(error)))
                else:
                    self.send(Reply(call_id, None, result))
            case Close():
                return False
        return True


def serve_engine(load: Callable[[], LLMEngine], loras: dict[str, Path],
                 commands: Connection, events: Connection) -> None:
    """Build the engine (`load`, the adapters, the warm-up), report it ready and serve the
    front end's messages until told to stop; this thread then owns all of its torch work
    but the building of compiled steps in the background (`compile_in_background`), which
    starts once the engine is ready."""
    lock = threading.Lock()

    def send(message: object) -> None:
        with lock:  # the loading reporter sends too
            events.send(message)

    loading = threading.Event()
    reporter = threading.Thread(target=_report_loading, args=(send, loading),
                                name="lathe-engine-loading", daemon=True)
    reporter.start()
    core: EngineCore | None = None
    try:
        try:
            engine = load()
            for name, folder in loras.items():
                engine.add_adapter(name, folder)

            def warming(done: int, total: int) -> None:  # also after Ready, in the background
                send(Status(f"warming up: {done}/{total} compiled decode steps built"))
                if core is not None:
                    core.poke()
            if not engine.builds_in_background:
                engine.warm_up(warming)
        except Exception as error:
            if not isinstance(error, LatheError):  # a user's to fix: its message says it all
                log.exception("loading the engine failed")
            loading.set()
            send(Failed(portable(error)))
            return
        finally:
            loading.set()
            reporter.join()
        info = ModelInfo(engine.limits, engine.tokenizer.to_str()
                         if engine.tokenizer is not None else None,
                         sorted(engine.eos_token_ids),
                         {name: str(folder) for name, folder in loras.items()},
                         torch.get_num_threads())
        core = EngineCore(engine, send)
        core.read(commands)
        freeze_startup_heap()
        send(Deltas([], engine.stats()))  # /metrics has the engine's state from the start
        send(Ready(info))
        if engine.builds_in_background:  # from now on: nothing before Ready shares the cores
            engine.warm_up(warming)
        try:
            core.run()
        finally:  # closed, or the front end gone: a background build still running ends quietly
            if engine.runner.graphs is not None:
                engine.runner.graphs.stopping = True
    except (BrokenPipeError, EOFError, OSError):  # the front end is gone: nobody to tell
        pass
    finally:
        events.close()
        gc.unfreeze()


def _report_loading(send: Callable[[object], None], loading: threading.Event) -> None:
    """While the engine loads, what it waits for (a native kernel build, say) as `Status`."""
    said = None
    while not loading.wait(STATUS_SECONDS):
        status = build_status()
        if status is not None and status != said:
            said = status
            send(Status(status))


