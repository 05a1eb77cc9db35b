"""Tool calls run in child processes, each bounded in time, memory and output size.

A tool is code the run did not write, called with arguments a model wrote. Each call goes
to one of a few children (`lathe.core.worker_pool`) that imported the tools once, which
forks a process for the call alone: its arguments are validated against the signature
there (pydantic), what it prints is kept off the pipe and capped, and its answer must be
text or JSON. The call's process holds none of the worker's pipes (a tool that writes to
every descriptor it can find cannot answer another call), leads a process group of its own
that is killed when the call ends (processes the tool started die with it) and dies with
the worker. A tool that raises, exits, hangs past `seconds`, prints or returns more than
`max_chars`, or returns something else gives a `ToolResult` whose content says so — a tool
message the model reads — and a hung or dead child is replaced; the caller never crashes
on a tool. (A tool that starts a new session escapes the group: that takes a container.)
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn

from lathe.core.worker_pool import (
    WorkerError,
    WorkerPool,
    WorkerTimeout,
    die_with_parent,
    limit_memory,
    serve_lines,
)
from lathe.data.tools import Tool

TOOL_SECONDS = 5.0
MAX_OUTPUT_CHARS = 4096
MEMORY_BYTES = 4 << 30


@dataclass(frozen=True)
class ToolResult:
    content: str  # what the tool message says: the tool's answer, or "error: ..."
    error: bool = False


class ToolRunner:
    """Calls of `tools` by name, each in a child process (`processes` at once)."""

    def __init__(self, tools: Sequence[Tool], seconds: float = TOOL_SECONDS,
                 max_chars: int = MAX_OUTPUT_CHARS, memory_bytes: int = MEMORY_BYTES,
                 processes: int = 2) -> None:
        self.tools = {tool.name: tool for tool in tools}
        self.seconds, self.max_chars, self.processes = seconds, max_chars, processes
        self.pool = WorkerPool("lathe.data.tool_runner", [str(memory_bytes)],
                               {"tools": {t.name: t.path for t in tools},
                                "max_chars": max_chars}, processes)

    def definitions(self) -> list[dict[str, Any]]:
        """The tools' OpenAI definitions, for a request's or a chat's `tools`."""
        return [tool.definition for tool in self.tools.values()]

    def run(self, name: str, arguments: str | dict[str, Any]) -> ToolResult:
        """Call tool `name` with `arguments` (an object, or its JSON text)."""
        if name not in self.tools:
            return _failed(f"there is no tool {name!r}; the tools are "
                           f"{', '.join(self.tools) or 'none'}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                return _failed(f"the arguments of {name} are not JSON: {arguments[:200]!r}")
        if not isinstance(arguments, dict):
            return _failed(f"the arguments of {name} must be a JSON object")
        try:  # the worker stops the call at `seconds`; the pool's limit is the backstop
            answer = self.pool.call({"name": name, "arguments": arguments,
                                     "seconds": self.seconds}, self.seconds + 2,
                                    6 * self.max_chars + 4096)
        except WorkerTimeout:
            return _failed(f"{name} did not finish within {self.seconds:g} s; it was stopped")
        except WorkerError as error:
            return _failed(f"{name} could not run: {error}")
        if "error" in answer:
            return _failed(answer["error"])
        return ToolResult(answer["content"])

    def run_many(self, calls: Sequence[tuple[str, str | dict[str, Any]]]) -> list[ToolResult]:
        """Several calls, `processes` at a time; results in order."""
        if len(calls) <= 1:
            return [self.run(name, arguments) for name, arguments in calls]
        with ThreadPoolExecutor(self.processes) as executor:
            return list(executor.map(lambda call: self.run(*call), calls))

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _failed(reason: str) -> ToolResult:
    return ToolResult(f"error: {reason}", error=True)


class _CappedText(io.TextIOBase):
    """sys.stdout and sys.stderr of a call: keeps the first `limit` characters."""

    def __init__(self, limit: int) -> None:
        self.limit, self.parts, self.size = limit, [], 0

    def write(self, text: str) -> int:
        if self.size <= self.limit:
            self.parts.append(text[:self.limit + 1 - self.size])
        self.size += len(text)
        return len(text)

    def text(self) -> str:
        return "".join(self.parts)


def _setup(message: dict[str, Any]) -> dict[str, Any]:
    import pydantic

    from lathe.data.tools import import_function
    return {"max_chars": message["max_chars"],
            "tools": {name: pydantic.validate_call(import_function(path, "tool"))
                      for name, path in message["tools"].items()}}


def _validation_text(error: Any) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'arguments'}: {e['msg']}"
                     for e in error.errors(include_url=False))


def _call(state: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The worker's side of a call: fork its process, read its answer within the call's
    time and size, then kill its process group."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        _run_forked(state, request, write_end)
    os.close(write_end)
    try:
        os.setpgid(pid, pid)  # also in the child: whichever runs first
    except OSError:  # it has already exited, or set it itself
        pass
    name, bound = request["name"], 6 * state["max_chars"] + 4096
    deadline = time.monotonic() + request["seconds"]
    data, answer = b"", None
    try:
        while len(data) <= bound:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([read_end], [], [], remaining)[0]:
                answer = {"error": f"{name} did not finish within {request['seconds']:g} s; "
                                   "it was stopped"}
                break
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            data += chunk
        else:
            answer = {"error": f"{name} wrote more than {bound:,} bytes of answer"}
    finally:
        os.close(read_end)
        for kill in (os.killpg, os.kill):  # the group (what the tool started), its leader
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if answer is not None:
        return answer
    try:  # the last line: the tool may have written to its own pipe before it
        answer = json.loads(data.rstrip(b"\n").rpartition(b"\n")[2])
    except (json.JSONDecodeError, UnicodeDecodeError):
        answer = None
    if not isinstance(answer, dict) or not ("content" in answer or "error" in answer):
        how = f"exited (code {code})" if code >= 0 else f"was killed (signal {-code})"
        return {"error": f"{name} {how} without answering"}
    return answer


def _run_forked(state: dict[str, Any], request: dict[str, Any], write_end: int) -> NoReturn:
    """The call's own process: a group of its own, no descriptor of the worker's but the
    answer's pipe, the tool's answer written there, then gone."""
    try:
        os.setpgid(0, 0)
        die_with_parent()
        os.dup2(os.open(os.devnull, os.O_RDWR), 0)  # the worker's requests are not its own
        os.closerange(3, write_end)
        os.closerange(write_end + 1, os.sysconf("SC_OPEN_MAX"))
        payload = b"\n" + json.dumps(_answer(state, request)).encode() + b"\n"
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
    finally:
        os._exit(0)


def _answer(state: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    import pydantic

    name, limit = request["name"], state["max_chars"]
    printed = _CappedText(limit)
    sys.stdout = sys.stderr = printed
    try:
        result = state["tools"][name](**request["arguments"])
    except pydantic.ValidationError as error:
        return {"error": f"bad arguments for {name}: {_validation_text(error)}"}
    except BaseException as error:  # noqa: BLE001 - a tool's failure is its answer
        return {"error": f"{name} raised {type(error).__name__}: {str(error)[:limit]}"}
    if printed.size > limit:
        return {"error": f"{name} printed {printed.size:,} characters, more than the limit of "
                         f"{limit:,}"}
    if result is None:
        content = printed.text()
    elif isinstance(result, str):
        content = result
    else:
        try:
            content = json.dumps(result, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            return {"error": f"{name} returned a {type(result).__name__}, which is neither "
                             "text nor JSON"}
    if len(content) > limit:
        return {"error": f"{name} returned {len(content):,} characters, more than the limit "
                         f"of {limit:,}"}
    return {"content": content}


if __name__ == "__main__":
    limit_memory(int(sys.argv[1]))
    serve_lines(_setup, _call)
