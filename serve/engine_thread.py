"""The one thread that does a server's torch work: loading the model, adapters, and every
engine step — and that steps the engine on its own, back to back, while it has work.

Why one thread: each thread that enters an ATen parallel region gets an OpenMP team of its
own, and on a CPU two teams contend for the same cores even when one is idle. Measured on
the 2-core machine (88M model, int8, 16 sequences): engine steps in the main thread ran at
~2.0 CPU-seconds per wall second; the same steps in a worker thread after the model was
built in another thread ran at ~1.55 and 20–25% slower; building the model *and* stepping
in one worker thread ran at 2.0 again. So everything that runs torch for the server goes
through this thread, and the event loop thread runs none.

Why it steps on its own (as vLLM's engine core busy-loops beside its front end): when each
step was a job the event loop handed over and awaited, every token paid the round trip —
the loop had to wake, take the GIL, route the step's output and hand over the next step
while the engine thread sat idle — and the asyncio hops in between each gave the GIL away.
On the README model at one stream that was ~0.2 ms a token on top of a 0.22 ms step. Here
the engine thread starts the next step as soon as it has posted the last one's output.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

# called on the engine thread between jobs: True while it has more work (call it again at
# once), False when idle (the thread sleeps until a job or `wake`); it must not raise (the
# thread would end): it reports its own failures, as `AsyncEngine` fails its streams
Stepper = Callable[[], bool]


class EngineThread:
    """A dedicated thread: jobs (`run`) in the order given, and between them, while its
    stepper reports work, one engine step after another."""

    def __init__(self) -> None:
        self._jobs: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._wake = threading.Event()
        self._stepper: Stepper | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._main, name="lathe-engine", daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the engine thread, after the jobs queued before it (and at most
        the step under way)."""
        if self._closed:
            raise RuntimeError("the engine thread is closed")
        future: Future = Future()
        self._jobs.append((lambda: fn(*args), future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def set_stepper(self, stepper: Stepper | None) -> None:
        """Step with `stepper` whenever no job is waiting (None: stop stepping)."""
        self._stepper = stepper
        self._wake.set()

    def wake(self) -> None:
        """Call the stepper again: new work may have arrived."""
        self._wake.set()

    def close(self) -> None:
        """Stop after the step under way; queued jobs are cancelled."""
        self._closed = True
        self._stepper = None
        self._wake.set()

    def _main(self) -> None:
        while True:
            self._wake.clear()  # before looking for work: a `wake` after this is kept
            while self._jobs:
                job, future = self._jobs.popleft()
                if self._closed:
                    future.cancel()
                elif future.set_running_or_notify_cancel():
                    try:
                        future.set_result(job())
                    except BaseException as error:  # the awaiting side raises it
                        future.set_exception(error)
            if self._closed:
                return
            stepper = self._stepper
            if stepper is None or not stepper():
                self._wake.wait()
