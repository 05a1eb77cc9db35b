"""Responses run in the background (`background: true`, OpenAI's mode for long jobs): the
request is answered at once with its response `queued` and stored; a task of the server's
own generates the reply, storing the response `in_progress` and then as it ends —
`completed` or `incomplete`, `failed` with the error, or `cancelled`. The client polls GET
/v1/responses/{id} and may POST /v1/responses/{id}/cancel (`lathe.serve.serving_responses`).

The task's chat request runs without the HTTP request's connection, which closes once the
queued response is sent (`detached`): nothing ends it but a cancel, a DELETE of the
response, or the server's shutdown (`close`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from fastapi import Request
from starlette.types import Message

log = logging.getLogger("lathe.serve")


def detached(request: Request) -> Request:
    """`request` (its app, headers and client) with no connection to lose: its `receive`
    never reports a disconnect, so a route that aborts on one runs to its end."""
    async def receive() -> Message:
        await asyncio.Future()  # waits until cancelled: there is no client to leave
        raise AssertionError("unreachable")
    return Request(request.scope, receive)


class BackgroundResponses:
    """The background responses still running, by response id."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, response_id: str, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks[response_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(response_id, None))

    def running(self, response_id: str) -> bool:
        return response_id in self._tasks

    async def cancel(self, response_id: str) -> None:
        """Cancel a running response and wait until it has stored itself `cancelled`."""
        task = self._tasks.get(response_id)
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def close(self) -> None:
        """Cancel every running response (the server is stopping)."""
        running = list(self._tasks)
        if running:
            log.info("cancelling %d background responses still running", len(running))
        await asyncio.gather(*(self.cancel(response_id) for response_id in running))
