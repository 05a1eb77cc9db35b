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

import sys
from typing import Any

from lathe.core.errors import CheckpointError
from lathe.core.worker_pool import WorkerError, WorkerPool, WorkerTimeout, limit_memory, serve_lines
from lathe.data.chat_template import CHECK_MESSAGES, CHECK_TOOLS, ChatTemplate, ChatTemplateError

RENDER_SECONDS = 2.0
REQUEST_TEMPLATES = 16  # templates sent with requests, kept compiled in each child
MAX_OUTPUT_CHARS = 1 << 20
MEMORY_BYTES = 1 << 30


class TemplateWorker:
    """`ChatTemplate.render` across a process boundary, bounded in time, memory and size.

    `render` blocks for at most about `seconds` and may be called from several threads.
    """

    def __init__(self, template: str, special_tokens: dict[str, str],
                 seconds: float = RENDER_SECONDS, max_chars: int = MAX_OUTPUT_CHARS,
                 memory_bytes: int = MEMORY_BYTES, processes: int = 2) -> None:
        self.seconds, self.max_chars, self.memory_bytes = seconds, max_chars, memory_bytes
        self.pool = WorkerPool("lathe.data.template_worker", [str(memory_bytes)],
                               {"template": template, "special_tokens": special_tokens,
                                "max_chars": max_chars}, processes,
                               start_seconds=seconds * 5)  # a cold start imports Jinja

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None,
               documents: list[dict[str, Any]] | None = None, template: str | None = None,
               client: str = "", **kwargs: Any) -> str:
        """The prompt text (`ChatTemplate.render`'s arguments); `ChatTemplateError` when the
        template refuses or fails on the messages, runs past the time limit, or renders
        more than `max_chars`. `template`: a template of the request's own, rendered in
        place of the checkpoint's (with its special tokens). `client`: who asks — while
        every child is busy, the next free one goes to the client with the fewest renders
        running, so one client's slow renders cannot hold the others back."""
        try:
            answer = self.pool.call({"messages": messages,
                                     "add_generation_prompt": add_generation_prompt,
                                     "tools": tools, "documents": documents, "kwargs": kwargs,
                                     "template": template},
                                    self.seconds, 6 * self.max_chars + 4096, key=client)
        except WorkerTimeout:
            raise ChatTemplateError(
                f"the chat template did not render these messages within {self.seconds:g} s "
                f"and {self.memory_bytes >> 20} MiB; it was stopped") from None
        except WorkerError as error:
            raise ChatTemplateError(f"the chat template renderer: {error}") from None
        if "error" in answer:
            raise ChatTemplateError(answer["error"])
        return answer["text"]

    def check(self) -> None:
        """Raise `CheckpointError` unless the template renders one user message within the
        limits, with no tools or, for a template written for tool use, with one (run once
        at load, so a broken template is reported there)."""
        try:
            self.render(CHECK_MESSAGES)
        except ChatTemplateError as error:
            try:
                self.render(CHECK_MESSAGES, tools=CHECK_TOOLS)
            except ChatTemplateError:
                raise CheckpointError(f"its chat template cannot render one user message: "
                                      f"{error}") from None

    def close(self) -> None:
        """Stop every child (renders still running fail)."""
        self.pool.close()


def _setup(message: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"template": ChatTemplate(message["template"], message["special_tokens"]),
                "special_tokens": message["special_tokens"], "requested": {},
                "max_chars": message["max_chars"]}
    except MemoryError:
        raise CheckpointError("the chat template does not parse: out of memory") from None


def _template(state: dict[str, Any], source: str | None) -> ChatTemplate:
    """The checkpoint's template, or a request's own (compiled once, the latest few kept)."""
    if source is None:
        return state["template"]
    requested: dict[str, ChatTemplate] = state["requested"]
    template = requested.pop(source, None)
    if template is None:
        try:
            template = ChatTemplate(source, state["special_tokens"])
        except (CheckpointError, MemoryError) as error:
            raise ChatTemplateError(f"the request's chat_template: {error}") from None
        if len(requested) >= REQUEST_TEMPLATES:
            requested.pop(next(iter(requested)))
    requested[source] = template
    return template


def _render(state: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    try:
        template = _template(state, request.get("template"))
        text = template.render(request["messages"], request["add_generation_prompt"],
                               request["tools"], request["documents"], **request["kwargs"])
    except ChatTemplateError as error:
        return {"error": str(error)}
    if len(text) > state["max_chars"]:
        return {"error": f"the chat template rendered {len(text):,} characters, more than "
                         f"the limit of {state['max_chars']:,}"}
    return {"text": text}


if __name__ == "__main__":
    limit_memory(int(sys.argv[1]))
    serve_lines(_setup, _render)
