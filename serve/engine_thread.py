"""The one thread that does a server's torch work: loading the model, adapters, and every
engine step.

Why one: each thread that enters an ATen parallel region gets an OpenMP team of its own,
and on a CPU two teams contend for the same cores even when one is idle. Measured on the
2-core machine (88M model, int8, 16 sequences): engine steps in the main thread ran at
~2.0 CPU-seconds per wall second; the same steps in a worker thread after the model was
built in another thread ran at ~1.55 and 20–25% slower, whether that worker was a fresh
`asyncio.to_thread` thread each step or one persistent thread; building the model *and*
stepping in one worker thread ran at 2.0 again, as fast as the main thread. So everything
that runs torch for the server goes through this thread, and the event loop thread runs
none.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A single worker thread, awaited from asyncio code."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lathe-engine")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the engine thread, after whatever was queued there before it."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(fn, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
