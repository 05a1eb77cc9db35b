"""`lathe chat`: a streaming terminal chat with a local checkpoint or a running server.

Both back ends take the conversation so far and yield the reply's text as it is
generated: `LocalChat` runs an `LLMEngine` in-process through the checkpoint's chat
template, `RemoteChat` reads Server-Sent Events from `/v1/chat/completions`. A reasoning
model's thinking is shown as it comes (after `[thinking] `) but only its answer is kept.
The loop keeps the history and understands `/reset`, `/system TEXT` and `/quit`.

With tools to run (`lathe chat URL --tool calculator`), a reply that calls them is answered
as an OpenAI client would: the calls run here (`lathe.data.tool_runner`, bounded child
processes), their results go back as tool messages, and the server is asked again, until
a reply without calls (at most `MAX_TOOL_TURNS` rounds).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch

from lathe.data.chat_encoding import chat_encoder
from lathe.data.tool_runner import ToolRunner
from lathe.serve.config import QuantMode
from lathe.serve.engine import LLMEngine
from lathe.serve.reasoning import ReasoningStream, template_reasoning_parser
from lathe.serve.sampling_defaults import with_defaults
from lathe.serve.sampling_params import SamplingParams

HELP = "commands: /reset (forget the conversation), /system TEXT (set the system prompt), /quit"
MAX_TOOL_TURNS = 4


@dataclass(frozen=True)
class Aside:
    """Text a reply shows but the conversation does not keep: the model's reasoning, the
    calls it makes."""

    text: str


class Thinking:
    """A reply's reasoning and answer as they stream, as `say` takes them: the reasoning
    shown after `[thinking] ` (an aside), a line break where the answer or a call follows
    it, the answer kept."""

    def __init__(self) -> None:
        self.open = False

    def pieces(self, reasoning: str, content: str, ends: bool = False
               ) -> Iterator[str | Aside]:
        """`ends`: something else (a call) follows the reasoning."""
        if reasoning:
            yield Aside(("" if self.open else "[thinking] ") + reasoning)
            self.open = True
        if self.open and (content or ends):
            yield Aside("\n")
            self.open = False
        if content:
            yield content


class ChatBackend(Protocol):
    def reply(self, messages: list[dict[str, str]], sampling: dict[str, Any]
              ) -> Iterator[str | Aside]:
        ...


class LocalChat:
    """The checkpoint's engine in this process; a template that renders `<think>` (or
    `[THINK]`) has its model's reasoning split off as `lathe serve` splits it."""

    def __init__(self, checkpoint: Path, quantize: QuantMode | None = None,
                 chat_template: Path | None = None, dtype: torch.dtype | None = None) -> None:
        self.engine = LLMEngine.from_checkpoint(checkpoint, quantize=quantize, dtype=dtype)
        self.encoder = chat_encoder(checkpoint, chat_template, tokenizer=self.engine.tokenizer)
        self.reasoning = template_reasoning_parser(self.encoder.template.source)

    def reply(self, messages: list[dict[str, str]], sampling: dict[str, Any]
              ) -> Iterator[str | Aside]:
        text = self.encoder.render(messages)
        prompt = self.encoder.encode(text)
        room = self.engine.max_model_len - len(prompt)
        fields = with_defaults(sampling, self.engine.sampling_defaults)  # as `lathe serve`
        # the parser reads markers that may be special tokens (Magistral's [THINK]), as
        # `lathe serve`'s does
        params = SamplingParams(**{**fields, "max_tokens": min(fields["max_tokens"], room)},
                                **({"skip_special_tokens": False} if self.reasoning else {}))
        split = ReasoningStream(self.reasoning, self.reasoning.starts_inside(text)) \
            if self.reasoning is not None else None
        shown = Thinking()
        request_id = self.engine.add_request(prompt, params)
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    yield from shown.pieces(*split.feed(delta.text)) if split is not None \
                        else (delta.text,)
            if split is not None:
                yield from shown.pieces(*split.finish())
        finally:
            self.engine.abort(request_id)


class RemoteChat:
    """`tools`: OpenAI tool definitions sent with every request; the calls the model makes
    are shown as `[tool call NAME(ARGUMENTS)]` and kept in `calls` (OpenAI's form) for the
    caller to run. A reasoning model's `reasoning_content` is shown as it streams, after
    `[thinking] `, and left out of the conversation."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        self.base = url.rstrip("/").removesuffix("/v1") + "/v1"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model or self._first_model()
        self.tools = tools
        self.calls: list[dict[str, Any]] = []

    def _first_model(self) -> str:
        response = httpx.get(f"{self.base}/models", headers=self.headers, timeout=30)
        _raise_for_error(response)
        return response.json()["data"][0]["id"]

    def reply(self, messages: list[dict[str, str]], sampling: dict[str, Any]
              ) -> Iterator[str | Aside]:
        body = {"model": self.model, "messages": messages, "stream": True, **sampling}
        if self.tools:
            body["tools"] = self.tools
        self.calls = []
        with httpx.stream("POST", f"{self.base}/chat/completions", json=body,
                          headers=self.headers, timeout=None) as response:
            if response.status_code != 200:
                response.read()
                _raise_for_error(response)
            shown = Thinking()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:  # the request failed after the stream opened
                    raise RuntimeError(f"server error: {event['error']['message']}")
                for choice in event["choices"]:
                    delta = choice["delta"]
                    yield from shown.pieces(delta.get("reasoning_content") or "",
                                            delta.get("content") or "",
                                            ends=bool(delta.get("tool_calls")))
                    for call in delta.get("tool_calls") or []:
                        function = call.get("function", {})
                        self.calls.append({"type": "function", "id": call.get("id"),
                                           "function": function})
                        yield Aside(f"\n[tool call {function.get('name')}"
                                    f"({function.get('arguments', '')})]")


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise RuntimeError(f"server answered {response.status_code}: {message}")


def say(backend: ChatBackend, messages: list[dict[str, Any]], sampling: dict[str, Any],
        write: Callable[[str], Any], tools: ToolRunner | None = None) -> list[dict[str, Any]]:
    """Stream one reply to `write`; with `tools`, run the calls it makes, show their
    results as `[NAME -> RESULT]`, and ask again. Returns the messages the reply added
    (the calls and their results, then the answer)."""
    added: list[dict[str, Any]] = []
    for _ in range(MAX_TOOL_TURNS + 1):
        parts = []
        for piece in backend.reply(messages + added, sampling):
            if isinstance(piece, Aside):
                write(piece.text)
            else:
                parts.append(piece)
                write(piece)
        calls = getattr(backend, "calls", []) if tools is not None else []
        if not calls:
            added.append({"role": "assistant", "content": "".join(parts)})
            return added
        # the text the model wrote beside its calls stays in its turn (the next prompt then
        # renders what it wrote, and the prefix cache holds it)
        added.append({"role": "assistant", "content": "".join(parts) or None,
                      "tool_calls": calls})
        results = tools.run_many([(c["function"].get("name", ""),
                                   c["function"].get("arguments") or "{}") for c in calls])
        for call, result in zip(calls, results, strict=True):
            write(f"\n[{call['function'].get('name')} -> {result.content}]\n")
            added.append({"role": "tool", "tool_call_id": call["id"], "content": result.content})
    write(f"\n(stopped after {MAX_TOOL_TURNS} rounds of tool calls)")
    return added


def write_stdout(text: str) -> None:
    print(text, end="", flush=True)


def chat_loop(backend: ChatBackend, sampling: dict[str, Any], system: str | None,
              read: Callable[[str], str] = input, write: Callable[[str], Any] = write_stdout,
              tools: ToolRunner | None = None) -> list[dict[str, Any]]:
    """Run the conversation until /quit or end of input; returns the final history."""
    history: list[dict[str, str]] = []
    write(HELP + "\n")
    while True:
        try:
            line = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            return history
        if line in ("/quit", "/exit"):
            return history
        if line == "/reset":
            history = []
            write("(conversation cleared)\n")
            continue
        if line.startswith("/system"):
            system = line.removeprefix("/system").strip() or None
            history = []
            write(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)\n")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        write("assistant> ")
        try:
            added = say(backend, messages, sampling, write, tools)
        except KeyboardInterrupt:
            added = [{"role": "assistant", "content": ""}]
        write("\n")
        history += added
