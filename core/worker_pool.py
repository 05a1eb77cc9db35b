"""A few child processes that answer JSON-line requests, each bounded in time and size.

Code a long-running process did not write — a checkpoint's chat template, a user's tool —
runs in a child started as `python -m MODULE ARGS...`: the caller waits at most the
seconds it gives, then the child is killed and replaced on next use, so a loop, a hang
or a crash costs one request, never the caller. Requests and answers cross the pipe as
JSON lines; nothing is unpickled. The child reads a setup line first and answers it
(`{"ready": true}` or `{"error": ...}`); a child whose parent dies exits within a fifth of
a second, busy or not. `call` may be made from several threads: each takes an idle child.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any


class _Child:
    """One child process and the pipe to it."""

    def __init__(self, argv: list[str], setup: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a terminal's Ctrl-C is for the parent to handle
        self.buffer = b""
        self.ended = False  # its end of the pipe closed: it exited (or is exiting)
        self.send(setup)

    def send(self, message: dict[str, Any]) -> None:
        self.process.stdin.write(json.dumps(message).encode() + b"\n")
        self.process.stdin.flush()

    def receive(self, seconds: float, max_bytes: int) -> dict[str, Any] | None:
        """The child's next answer, or None when it gives none in `seconds`, exits, or
        writes more than `max_bytes`."""
        out = self.process.stdout.fileno()
        deadline = time.monotonic() + seconds
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([out], [], [], remaining)[0]:
                return None
            chunk = os.read(out, 1 << 16)
            self.ended = not chunk
            if not chunk or len(self.buffer) + len(chunk) > max_bytes:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):  # unsent bytes to a dead child: a broken pipe
                stream.close()


class WorkerError(RuntimeError):
    """A child did not start or exited without answering, or the pool is closed."""


class WorkerTimeout(WorkerError):
    """A child gave no answer within the call's time and size limits; it was stopped."""


class WorkerPool:
    """`processes` children of `python -m module *args`, each started on first use with
    the `setup` message. A child that comes free goes to the waiting call whose `key` (a
    client) has the fewest calls running, the earliest first among equals: one client's
    burst of slow calls queues behind the other clients' calls instead of ahead of them."""

    def __init__(self, module: str, args: list[str], setup: dict[str, Any],
                 processes: int = 2, start_seconds: float = 10.0) -> None:
        self.argv = [sys.executable, "-m", module, *args]
        self.setup, self.start_seconds = setup, start_seconds
        self._free: list[_Child | None] = [None] * processes  # None: starts on first use
        self._turns = threading.Condition()
        self._waiting: list[tuple[int, str]] = []  # (arrival, key) of each waiting call
        self._running: collections.Counter[str] = collections.Counter()  # calls by key
        self._arrivals = itertools.count()
        self._closed = False

    def call(self, request: dict[str, Any], seconds: float, max_bytes: int,
             key: str = "") -> dict[str, Any]:
        """The answer to `request`; `WorkerError` when the pool is closed, a child does not
        start (its setup answer's error, if it gave one); `WorkerTimeout` when it does not
        answer within `seconds` and `max_bytes` (then it is killed, and replaced on next
        use). `key`: whose call it is, for the order in which waiting calls get a child."""
        if self._closed:
            raise WorkerError("shut down")
        child = self._take(key)
        try:
            if child is None:
                child = _Child(self.argv, self.setup)
                ready = child.receive(self.start_seconds, 1 << 20)
                if ready is None or "error" in ready:
                    child.kill()
                    child = None
                    raise WorkerError((ready or {}).get("error") or "did not start")
            try:
                child.send(request)
            except OSError:  # it died since its last answer: its pipe is closed
                child.kill()
                child = None
                raise WorkerError("its process had exited; it is replaced") from None
            answer = child.receive(seconds, max_bytes)
            if answer is None:
                code = None
                if child.ended:  # the pipe closes a moment before the process is reaped
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        code = child.process.wait(timeout=5)
                child.kill()
                child = None
                if code is not None:
                    raise WorkerError(f"its process exited (code {code}) without answering")
                raise WorkerTimeout(f"no answer within {seconds:g} s and {max_bytes:,} "
                                    "bytes; it was stopped")
            return answer
        finally:
            self._give_back(child, key)

    def _take(self, key: str) -> _Child | None:
        """A free child (or a slot to start one in), when it is this call's turn."""
        with self._turns:
            turn = (next(self._arrivals), key)
            self._waiting.append(turn)
            try:
                while not self._free or min(
                        self._waiting, key=lambda t: (self._running[t[1]], t[0])) != turn:
                    if self._closed:
                        raise WorkerError("shut down")
                    self._turns.wait()
            finally:
                self._waiting.remove(turn)
            self._running[key] += 1
            return self._free.pop()

    def _give_back(self, child: _Child | None, key: str) -> None:
        with self._turns:
            if self._closed and child is not None:
                child.kill()
                child = None
            self._free.append(child)
            self._running[key] -= 1
            if not self._running[key]:
                del self._running[key]
            self._turns.notify_all()

    def close(self) -> None:
        """Stop every idle child, and each running one when its call ends; waiting calls
        fail."""
        with self._turns:
            self._closed = True
            free, self._free = self._free, []
            self._turns.notify_all()  # waiting calls fail
        for child in free:
            if child is not None:
                child.kill()


def limit_memory(memory_bytes: int) -> None:
    """Cap the calling (child) process's address space, where the platform allows."""
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ImportError, ValueError, OSError):
        pass  # no address-space limit on this platform; the time limit still holds


def die_with_parent(every: float = 0.2) -> None:
    """Exit when the parent process dies, checked every `every` seconds on a thread of its
    own: a child busy in a render or a tool never reads the end of its input, and outlived a
    parent killed with SIGKILL, spinning on as an orphan. (Not PR_SET_PDEATHSIG: it fires
    when the parent *thread* ends, and children are started from short-lived threads.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def serve_lines(setup: Any, answer_one: Any) -> None:
    """The child's side: `setup(message) -> state` (raising to refuse, its text the error),
    then one answer per request line, `answer_one(state, request) -> dict`. The answers
    go out on the stdout the child started with; fds 1 and 2 are pointed at /dev/null
    first, so nothing the child's code prints can corrupt the pipe. The child dies with
    its parent (`die_with_parent`)."""
    die_with_parent()
    stdin = sys.stdin.buffer
    answers = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)

    def send(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message).encode() + b"\n")
        answers.flush()

    try:
        state = setup(json.loads(stdin.readline()))
    except Exception as error:  # noqa: BLE001 - a setup that fails is answered, not raised
        send({"error": str(error) or type(error).__name__})
        return
    send({"ready": True})
    for line in stdin:
        send(answer_one(state, json.loads(line)))
