"""What crosses between a server's front end and its engine core (`lathe.serve.engine_core`),
and the core process's entry point. No torch here: the front end imports this, the core's
process imports the engine.

The messages, dataclasses pickled by `multiprocessing`'s pipes (both ends are this package):

- front end → core: `AddRequest`, `Abort`, `Call` (of the engine methods in `CALLS`),
  `Close`.
- core → front end: `Status` while loading, then `Ready` (with the `ModelInfo`) or
  `Failed`; while serving `Deltas` after each step that produced output (its stats:
  `LLMEngine.stats()` at most every `engine_core.STATS_SECONDS`, and with the step that
  leaves it idle; else None), `Rejected` (a request that failed alone), `Reply` (to a
  `Call`), and `Dead` when a step fails (the engine's state is then unknown, so the core
  ends).

The core ends at `Close` or when the front end's pipe closes (the front end gone, however
it went); a core in a process of its own ignores SIGINT (a terminal's Ctrl-C reaches the
whole process group) and is stopped by its front end.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import pickle
import signal
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from lathe.serve.config import EngineConfig, QuantMode, WeightDtype
from lathe.serve.request_checks import RequestLimits

if TYPE_CHECKING:
    from lathe.serve.outputs import SequenceDelta
    from lathe.serve.sampling_params import SamplingParams

CALLS = ("add_adapter", "remove_adapter", "update_weights")  # what a front end may call
# calls that wait for an idle engine: admission pauses at them (requests sent after wait)
# until every running request has finished on the old weights
IDLE_CALLS = ("update_weights",)
PR_SET_PDEATHSIG = 1  # prctl(2)
# the environment variable naming the process a `lathe serve` started by another (a trainer's
# rollout server) ends with
END_WITH = "LATHE_END_WITH_PID"


@dataclass
class EngineSpec:
    """How a core builds its engine: it crosses to the core's process, so plain data."""

    checkpoint: Path
    config: EngineConfig = field(default_factory=EngineConfig)
    quantize: QuantMode | None = None
    dtype: WeightDtype = "auto"  # the weights' (auto: the checkpoint's)
    threads: int | None = None  # intra-op threads (None: `engine_threads` chooses)
    replica: int = 0  # which of `replicas` data-parallel cores this one is
    replicas: int = 1


@dataclass
class ModelInfo:
    """What the front end needs of a loaded engine to take requests without asking it."""

    limits: RequestLimits
    tokenizer: str | None  # the tokenizer's JSON
    eos_token_ids: list[int]
    adapters: dict[str, str]  # the adapters loaded at start: name -> folder
    threads: int  # the core's intra-op threads


# front end -> core
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Call:
    call_id: int
    method: str  # one of CALLS
    args: tuple


@dataclass(frozen=True)
class Close:
    pass


# core -> front end
@dataclass(frozen=True)
class Status:
    text: str  # what the start waits for


@dataclass(frozen=True)
class Ready:
    info: ModelInfo


@dataclass(frozen=True)
class Failed:
    error: BaseException  # what the load raised


@dataclass(frozen=True)
class Deltas:
    deltas: list[SequenceDelta]
    stats: dict[str, float] | None


@dataclass(frozen=True)
class Rejected:
    request_id: str
    error: BaseException


@dataclass(frozen=True)
class Reply:
    call_id: int
    error: BaseException | None
    result: object = None


@dataclass(frozen=True)
class Dead:
    message: str


def portable(error: BaseException) -> BaseException:
    """`error` as it can cross the pipe: itself when it pickles, else a RuntimeError that
    names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def freeze_startup_heap() -> None:
    """Move every object alive once serving starts (torch, the model, its compiled graphs:
    ~420,000 on the README model) out of the garbage collector's reach, as vLLM's engine
    does: a full collection walks them all — 220-280 ms on the README model on a 2-core CPU,
    a stall of every stream in flight whenever the oldest generation's turn comes — and
    ~0 ms once they are frozen. `gc.unfreeze()` at the end gives them back (else extensions
    report them as leaks at exit)."""
    gc.collect()
    gc.freeze()


def process_main(spec: EngineSpec, loras: dict[str, Path], commands: Connection,
                 events: Connection, front_end: int) -> None:
    """The core's process: serve the engine `spec` describes, for the front end of pid
    `front_end`. The engine core is imported here, in the core's process: the front end
    never imports torch."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when it ends
    end_with(front_end)
    from lathe.serve.engine_core import serve_spec
    serve_spec(spec, loras, commands, events)
    # End here, not through the interpreter's shutdown: a decode-graph build still running
    # on its daemon thread would race the teardown ("can't register atexit after
    # shutdown", or C++ threads destroyed while running: "terminate called"). The exit
    # handlers still run (semaphores released, logs flushed); the build, told the engine
    # is closing, ends without a word.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def end_with(front_end: int) -> None:
    """Have the kernel kill this process when its front end dies (Linux; strictly, when
    the front end's thread that started it ends). A closed pipe ends a serving core at its
    next message, but a loading one reads none: without this a core whose front end was
    killed would go on compiling for minutes."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != front_end:  # it died before the request was made
        os._exit(1)
