"""The engine thread: jobs run in order and report their results and errors to the awaiting
coroutine; between jobs its stepper is called back to back while it reports work, and again
on `wake`; a closed thread runs nothing more."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lathe.serve.engine_thread import EngineThread


def test_jobs_run_in_order_on_one_thread_and_raise_where_awaited():
    async def main() -> None:
        thread = EngineThread()
        names = await asyncio.gather(*(thread.run(lambda: threading.current_thread().name)
                                       for _ in range(3)))
        assert names == ["lathe-engine"] * 3
        order: list[int] = []
        await asyncio.gather(*(thread.run(order.append, i) for i in range(20)))
        assert order == list(range(20))
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
        thread.close()
        with pytest.raises(RuntimeError, match="closed"):
            await thread.run(print)
    asyncio.run(main())


def test_the_stepper_runs_back_to_back_while_it_has_work_and_again_when_woken():
    async def main() -> None:
        thread = EngineThread()
        work, calls, idle = [5], [], threading.Event()

        def step() -> bool:
            calls.append(work[0])
            if work[0] == 0:
                idle.set()
                return False
            work[0] -= 1
            return True
        thread.set_stepper(step)
        assert await asyncio.to_thread(idle.wait, 5)
        assert calls == [5, 4, 3, 2, 1, 0]
        # a job runs between steps, on the same thread; the stepper is asked again after it
        assert await thread.run(lambda: len(calls)) == 6
        work[0] = 2
        idle.clear()
        thread.wake()
        assert await asyncio.to_thread(idle.wait, 5)
        assert [c for c in calls if c] == [5, 4, 3, 2, 1, 2, 1]
        thread.close()
    asyncio.run(main())
