"""A chat choice's text as its client gets it: the reasoning split off first
(`lathe.serve.reasoning`), then tool calls read out of the answer that follows
(`lathe.serve.tool_calls`), whole or as it streams (each call as soon as it is complete, as
vLLM streams them), with OpenAI's finish reason — and the count of reasoning tokens for the
usage block.

A reply cut by max_tokens keeps the calls it completed. OpenAI ends a reply with calls as
"tool_calls", but a named `tool_choice` as "stop". With `parallel_tool_calls: false` a reply
returns its first call alone, as vLLM's does (a forced one is made to write no more).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from lathe.serve.reasoning import ReasoningParser, ReasoningStream
from lathe.serve.tool_calls import ToolCall, ToolCallParser, ToolStream


@dataclass(frozen=True)
class ReplyFormat:
    """How one chat request's choices are read. `starts_inside`: replies start in
    reasoning (read off the rendered prompt); `named_call`: `tool_choice` named a function."""

    reasoning: ReasoningParser | None = None
    starts_inside: bool = False
    tools: ToolCallParser | None = None
    named_call: bool = False
    parallel_calls: bool = True  # false: a reply's first call alone (vLLM's, OpenAI's)


@dataclass
class Reply:
    content: str
    reasoning: str | None = None  # None: the reply had none
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None


def _finish_reason(form: ReplyFormat, called: bool, reason: str | None) -> str | None:
    if called and reason == "stop" and not form.named_call:
        return "tool_calls"
    return reason


def whole_reply(form: ReplyFormat, text: str, finish_reason: str | None) -> Reply:
    """A finished choice's text read at once."""
    stream = ReplyStream(form)
    _, content, calls = stream.feed(text)
    end = stream.finish(finish_reason)
    return Reply(content + end.content, stream.reasoning, calls + end.calls, end.finish_reason)


class ReplyStream:
    """One streamed choice: `feed` returns the (reasoning, content) a client may see now
    (nothing of a call, nor of what may yet open a marker) and the calls completed since;
    `finish` returns the rest as a `Reply`, with the last calls. `reasoning`: all the
    reasoning so far (None: none); `called`: how many calls were handed out."""

    def __init__(self, form: ReplyFormat) -> None:
        self.form = form
        self.thinking = ReasoningStream(form.reasoning, form.starts_inside) \
            if form.reasoning is not None else None
        self.calls = ToolStream(form.tools) if form.tools is not None else None
        self._reasoning: list[str] = []  # joined when asked: a long think costs it once
        self.called = 0

    @property
    def reasoning(self) -> str | None:
        return "".join(self._reasoning) if self.thinking is not None and \
            self.thinking.reasoned else None

    def feed(self, delta: str) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.thinking.feed(delta) if self.thinking else ("", delta)
        self._reasoning.append(reasoning)
        calls: list[ToolCall] = []
        if self.calls is not None:
            content, calls = self.calls.feed(content)
        return reasoning, content, self._handed(calls)

    def finish(self, finish_reason: str | None) -> Reply:
        reasoning, content = self.thinking.finish() if self.thinking else ("", "")
        self._reasoning.append(reasoning)
        calls: list[ToolCall] = []
        if self.calls is not None:
            content, calls = self.calls.feed(content)
            rest, more = self.calls.finish(truncated=finish_reason == "length")
            content, calls = content + rest, self._handed(calls + more)
        return Reply(content, reasoning, calls,
                     _finish_reason(self.form, self.called > 0, finish_reason))

    def _handed(self, calls: list[ToolCall]) -> list[ToolCall]:
        """`calls` as the client gets them (without parallel calls, the reply's first
        alone), counted."""
        if not self.form.parallel_calls:
            calls = calls[:max(0, 1 - self.called)]
        self.called += len(calls)
        return calls


def reasoning_tokens(tokenizer: Tokenizer | None, token_ids: list[int],
                     reasoning: str | None, parser: ReasoningParser) -> int:
    """How many of a reply's tokens were reasoning (`reasoning`: its text, None when it
    had none): up to and including the end marker (`</think>`) when that is one token,
    else the reasoning text's own token count."""
    if reasoning is None:
        return 0
    end = tokenizer.token_to_id(parser.end) if tokenizer is not None else None
    if end is not None:
        return token_ids.index(end) + 1 if end in token_ids else len(token_ids)
    if tokenizer is None or not reasoning:
        return 0
    return len(tokenizer.encode(reasoning, add_special_tokens=False).ids)
