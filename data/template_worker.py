"""A chat template rendered in child processes with a time, memory and output-size limit.

A checkpoint's template is code its server did not write. Jinja's sandbox stops it from
touching the process, but not from looping (`range(99999)` nested twice), building a
gigabyte string or recursing: rendered in the server's own process, one such template
blocks every route, shutdown included. Here each render runs in a child process that
imports only Jinja: the caller waits at most `seconds`, then the child is killed and
replaced and the render fails with `ChatTemplateError`; the child's address space is
capped (`memory_bytes`) and a rendered prompt over `max_chars` is refused there.

Requests and answers cross the pipe as JSON lines; nothing is unpickled. A few children
serve renders at once (`processes`), each started on first use. A child whose parent dies
reads the end of its input and exits.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import time
from typing import Any

from lathe.core.errors import CheckpointError
from lathe.data.chat_template import CHECK_MESSAGES, ChatTemplate, ChatTemplateError

RENDER_SECONDS = 2.0
MAX_OUTPUT_CHARS = 1 << 20
MEMORY_BYTES = 1 << 30


class _Child:
    """One renderer process and the pipe to it."""

    def __init__(self, setup: dict[str, Any], memory_bytes: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lathe.data.template_worker", str(memory_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a terminal's Ctrl-C is for the parent to handle
        self.buffer = b""
        self.send(setup)

    def send(self, message: dict[str, Any]) -> None:
        self.process.stdin.write(json.dumps(message).encode() + b"\n")
        self.process.stdin.flush()

    def receive(self, seconds: float, max_bytes: int) -> dict[str, Any] | None:
        """The child's next answer, or None when it gives none in `seconds` (or exits)."""
        out = self.process.stdout.fileno()
        deadline = time.monotonic() + seconds
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([out], [], [], remaining)[0]:
                return None
            chunk = os.read(out, 1 << 16)
            if not chunk or len(self.buffer) + len(chunk) > max_bytes:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()


class TemplateWorker:
    """`ChatTemplate.render` across a process boundary, bounded in time, memory and size.

    `render` blocks for at most about `seconds` and may be called from several threads.
    """

    def __init__(self, template: str, special_tokens: dict[str, str],
                 seconds: float = RENDER_SECONDS, max_chars: int = MAX_OUTPUT_CHARS,
                 memory_bytes: int = MEMORY_BYTES, processes: int = 2) -> None:
        self.setup = {"template": template, "special_tokens": special_tokens,
                      "max_chars": max_chars}
        self.seconds, self.max_chars, self.memory_bytes = seconds, max_chars, memory_bytes
        self._idle: queue.Queue[_Child | None] = queue.Queue()
        for _ in range(processes):
            self._idle.put(None)  # a slot; its child starts on first use
        self._closed = False

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None,
               documents: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text (`ChatTemplate.render`'s arguments); `ChatTemplateError` when the
        template refuses or fails on the messages, runs past the time limit, or renders
        more than `max_chars`."""
        if self._closed:
            raise ChatTemplateError("the chat template renderer is shut down")
        child = self._idle.get()
        try:
            if child is None:
                child = _Child(self.setup, self.memory_bytes)
                ready = child.receive(self.seconds * 5, 1 << 20)  # a cold start imports Jinja
                if ready is None or "error" in ready:
                    child.kill()
                    child = None
                    raise ChatTemplateError((ready or {}).get("error") or
                                            "the chat template's renderer did not start")
            child.send({"messages": messages, "add_generation_prompt": add_generation_prompt,
                        "tools": tools, "documents": documents, "kwargs": kwargs})
            answer = child.receive(self.seconds, 6 * self.max_chars + 4096)
            if answer is None:
                child.kill()
                child = None
                raise ChatTemplateError(
                    f"the chat template did not render these messages within "
                    f"{self.seconds:g} s and {self.memory_bytes >> 20} MiB; it was stopped")
            if "error" in answer:
                raise ChatTemplateError(answer["error"])
            return answer["text"]
        finally:
            self._idle.put(child)

    def check(self) -> None:
        """Raise `CheckpointError` unless the template renders one user message within the
        limits (run once at load, so a broken template is reported there)."""
        try:
            self.render(CHECK_MESSAGES)
        except ChatTemplateError as error:
            raise CheckpointError(f"its chat template cannot render one user message: "
                                  f"{error}") from None

    def close(self) -> None:
        """Stop every child (renders still running fail)."""
        self._closed = True
        while True:
            try:
                child = self._idle.get_nowait()
            except queue.Empty:
                return
            if child is not None:
                child.kill()


def _serve(memory_bytes: int) -> None:
    """The child's loop: set up the template, then answer one JSON line per request."""
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ImportError, ValueError, OSError):
        pass  # no address-space limit on this platform; the time limit still holds
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

    def answer(message: dict[str, Any]) -> None:
        stdout.write(json.dumps(message).encode() + b"\n")
        stdout.flush()

    setup = json.loads(stdin.readline())
    try:
        template = ChatTemplate(setup["template"], setup["special_tokens"])
    except (CheckpointError, MemoryError) as error:
        answer({"error": str(error) or "the chat template does not parse: out of memory"})
        return
    answer({"ready": True})
    for line in stdin:
        request = json.loads(line)
        try:
            text = template.render(request["messages"], request["add_generation_prompt"],
                                   request["tools"], request["documents"], **request["kwargs"])
        except ChatTemplateError as error:
            answer({"error": str(error)})
            continue
        if len(text) > setup["max_chars"]:
            answer({"error": f"the chat template rendered {len(text):,} characters, more than "
                             f"the limit of {setup['max_chars']:,}"})
        else:
            answer({"text": text})


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
