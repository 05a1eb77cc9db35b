"""What a connection may cost the server, and how the server stops.

uvicorn's HTTP protocol waits forever for a connection's first bytes and for headers or
a body that trickle in, and its `limit_concurrency` answers 503 to /health too. Without
bounds, a thousand idle sockets use up the process's file descriptors and every route,
/health included, stops answering. `GuardedH11Protocol` (uvicorn's h11 protocol with
deadlines) closes a connection whose request headers are not complete `header_seconds`
after its first byte (or after it opened), or whose body is not complete `body_seconds`
after its headers; a connection idle between requests closes after `idle_seconds`. Past
`max_connections` open connections (or one client's share of them,
`max_connections_per_client`) a new connection first closes the least recently active
quiet one — open with no request under way, as a client hoarding sockets holds them — so
idle sockets never keep a real request out; when every connection is at work, the new one
is still read, with a one-second header deadline, but answers 503 to everything except
GET /health, and is closed after it.

`LatheServer` stops in bounds: the first SIGTERM or SIGINT stops accepting, lets
requests in flight finish for up to `drain_seconds`, ends what is left at 80% of it (the
app's `before_cut`: a stream's client gets an error event and `[DONE]`, a waiting one a
503; their sequences are aborted), then cancels whatever still runs; a second signal exits
at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lathe.core.config import cli
from lathe.core.errors import ConfigError

log = logging.getLogger("lathe.serve")

OVER_CAP_HEADER_SECONDS = 1.0
RESERVED_FILES = 256  # descriptors kept for model files, logs, children (a quarter at most)


@dataclass
class ConnectionLimits:
    max_connections: int = field(default=1024, metadata=cli(
        "open connections; past them only GET /health is answered, the rest get 503"))
    header_seconds: float = field(default=10.0, metadata=cli(
        "seconds a connection has to send a request's headers", flag="--header-timeout"))
    body_seconds: float = field(default=30.0, metadata=cli(
        "seconds a request has to send its body after its headers", flag="--body-timeout"))
    # longer than the 5 s httpx's pool (the openai client's) keeps an idle connection: the
    # client drops it first, and never sends a request on a socket the server is closing
    # ("Server disconnected without sending a response", which CI met at 5 s against 5 s)
    idle_seconds: float = field(default=10.0, metadata=cli(
        "seconds an idle connection stays open between requests",
        flag="--keep-alive-timeout"))
    drain_seconds: float = field(default=10.0, metadata=cli(
        "seconds requests in flight may finish after SIGTERM before they are aborted (a "
        "second signal exits at once)", flag="--shutdown-timeout"))
    max_connections_per_client: int = field(default=0, metadata=cli(
        "connections one client address may hold (0: half of --max-connections); past a cap "
        "the quietest idle connection is closed first"))

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ConfigError(f"max_connections={self.max_connections} must be >= 1")
        for name in ("header_seconds", "body_seconds", "idle_seconds", "drain_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        if self.max_connections_per_client < 0:
            raise ConfigError(f"max_connections_per_client={self.max_connections_per_client} "
                              "must be >= 0 (0: half of max_connections)")

    @property
    def per_client(self) -> int:
        return self.max_connections_per_client or max(self.max_connections // 2, 1)


def raise_file_limit(limits: ConnectionLimits) -> ConnectionLimits:
    """Raise this process's soft limit on open files to its hard limit, and lower
    `max_connections` (with a warning) to what that limit leaves room for: a connection
    over the cap still needs a descriptor to be answered."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    room = max((soft - min(RESERVED_FILES, soft // 4)) // 2, 1)  # half for those over the cap
    if limits.max_connections > room:
        log.warning("max_connections=%d lowered to %d: this process may open %d files",
                    limits.max_connections, room, soft)
        limits.max_connections = room
    return limits


async def _health_only(app: Any, scope: dict, receive: Any, send: Any) -> None:
    """The app for a connection over the cap: /health as usual, 503 for the rest."""
    if scope["type"] == "http" and scope["path"] == "/health" and scope["method"] == "GET":
        await app(scope, receive, send)
        return
    body = json.dumps({"error": {
        "message": "the server has too many open connections; retry shortly",
        "type": "service_unavailable", "param": None, "code": None}}).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines and a connection cap."""

    limits = ConnectionLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading: object = h11.IDLE  # the client's state when its last bytes came
        self._active = self.loop.time()  # when it last opened or sent bytes
        self._admitted = False  # counted against the caps (one over them is not)
        if self._over_cap():
            app = self.app
            self.app = lambda scope, receive, send: _health_only(app, scope, receive, send)
            self._arm(OVER_CAP_HEADER_SECONDS)
        else:
            self._admitted = True
            self._arm(self.limits.header_seconds)

    def _over_cap(self) -> bool:
        """Whether this new connection goes past a cap that no quiet connection can be
        closed to make room under: first its client's own (so one client cannot hold them
        all), then the server's."""
        peer = self.client[0] if self.client else None
        others = [c for c in self.connections if isinstance(c, GuardedH11Protocol)
                  and c is not self and c._admitted]
        mine = [c for c in others if c.client and c.client[0] == peer]
        if len(mine) >= self.limits.per_client and not self._close_quietest(mine):
            return True
        return len(others) >= self.limits.max_connections and not self._close_quietest(others)

    @staticmethod
    def _close_quietest(connections: list[GuardedH11Protocol]) -> bool:
        """Close the least recently active of `connections` that is quiet — no request
        received or being answered, an idle or keep-alive socket — to make room; False when
        every one is at work."""
        quiet = [c for c in connections if c._quiet()]
        if not quiet:
            return False
        oldest = min(quiet, key=lambda c: c._active)
        oldest.transport.close()
        oldest.connections.discard(oldest)  # its slot is free now, not when the loop closes it
        return True

    def _quiet(self) -> bool:
        return (self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE
                and not self.conn.trailing_data[0] and not self.transport.is_closing())

    def data_received(self, data: bytes) -> None:
        self._active = self.loop.time()
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE and self._deadline is None:  # a new request's first bytes
            self._arm(self.limits.header_seconds)
        elif state is h11.SEND_BODY and self._reading is not h11.SEND_BODY:
            self._arm(self.limits.body_seconds)
        elif state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()
        self._reading = state

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        """The client did not finish its request in time: close the connection (a request
        already handed to the app sees it as a disconnect)."""
        self._deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()


def protocol_with(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """`GuardedH11Protocol` bound to `limits` (uvicorn takes a protocol class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def uvicorn_config(app: Any, host: str, port: int, limits: ConnectionLimits,
                   log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=protocol_with(limits), timeout_keep_alive=limits.idle_seconds,
                          timeout_graceful_shutdown=limits.drain_seconds)


class LatheServer(uvicorn.Server):
    """uvicorn's server, but any second SIGTERM or SIGINT exits at once (uvicorn's own
    forces only a second SIGINT, and then still waits for its shutdown steps).

    "At once" is the kernel's default action: the first signal puts SIGTERM and SIGINT back
    to it. A Python handler for the second signal would run only when the main thread next
    holds the GIL, which a busy thread (an engine core run in this process) can delay by
    seconds on a loaded machine."""

    def __init__(self, config: uvicorn.Config,
                 before_cut: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.before_cut = before_cut

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, but `before_cut` is called when 80% of the drain time has
        passed: the app then ends its open requests itself (an error event and `[DONE]` for
        a stream, a 503 otherwise), which reach their clients before uvicorn's deadline
        cancels whatever still runs and cuts its connection."""
        drain = self.config.timeout_graceful_shutdown
        timer = None
        if drain is not None and self.before_cut is not None:
            timer = asyncio.get_running_loop().call_later(0.8 * drain, self.before_cut)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            for handled in (signal.SIGINT, signal.SIGTERM):
                signal.signal(handled, signal.SIG_DFL)
            drain = self.config.timeout_graceful_shutdown
            log.warning("signal %d: draining requests %s; a second signal exits at once", sig,
                        "until they end" if drain is None else f"for up to {drain:.3g} s")
        super().handle_exit(sig, frame)
