"""Reasoning output: the thinking a model writes between `<think>` and `</think>` (Qwen3,
DeepSeek-R1, SmolLM3, GLM-4.5), between `[THINK]` and `[/THINK]` (Magistral: the
`mistral` parser), or in Gemma 4's thought channel (`<|channel>thought\n` to `<channel|>`,
the `gemma4` parser), split from its answer, as vLLM's `--reasoning-parser` does —
`reasoning_content` beside `content` in a chat response, and as deltas of their own when
streamed.

Where a reply starts is read off the rendered prompt: a template that ends its generation
prompt inside an open `<think>` (DeepSeek-R1, Qwen3's thinking-only models) has the reply
start in reasoning; one that closed it (Qwen3 with `enable_thinking: false`) or never
opened it has the reply start in its answer, unless the reply itself opens with `<think>`.
The `deepseek_r1` parser has every reply start in reasoning (R1's first templates left the
opening tag to the model). A reply cut before `</think>` is all reasoning, streamed or not,
so the streamed deltas always add up to the unstreamed message.

A constraint on a reasoning model's reply (a JSON schema, a forced tool call) holds for its
answer: the model reasons freely first (`constraint_prefix`), as vLLM's structured outputs
apply once the reasoning ends. Constrained from its first token, a model whose prompt opens
`<think>` wrote its JSON or its call inside the reasoning, and the client got neither.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lathe.serve.structured import Literals, text_until

REASONING_PARSERS = ("qwen3", "deepseek_r1", "mistral", "gemma4")
START, END = "<think>", "</think>"
MISTRAL_START, MISTRAL_END = "[THINK]", "[/THINK]"  # Magistral's, special tokens
GEMMA4_START, GEMMA4_END = "<|channel>thought\n", "<channel|>"  # special tokens but "thought"


@dataclass(frozen=True)
class ReasoningParser:
    """`always_starts_inside`: every reply starts in reasoning (deepseek_r1); `start` and
    `end`: the markers around the reasoning."""

    name: str
    always_starts_inside: bool = False
    start: str = START
    end: str = END

    def starts_inside(self, prompt: str) -> bool:
        """Whether a reply to the rendered `prompt` starts in reasoning."""
        return self.always_starts_inside or prompt.rfind(self.start) > prompt.rfind(self.end)

    def split(self, text: str, inside: bool) -> tuple[str | None, str]:
        """(reasoning, content) of a whole reply; reasoning None when it has none."""
        stream = ReasoningStream(self, inside)
        reasoning, content = stream.feed(text)
        rest_reasoning, rest_content = stream.finish()
        if not stream.reasoned:
            return None, content + rest_content
        return reasoning + rest_reasoning, content + rest_content

    def constraint_prefix(self, inside: bool, literals: Literals,
                          eos_token_ids: Iterable[int]) -> str:
        """The start of a grammar that constrains only a reply's answer (`@answer`), as
        vLLM applies structured outputs once the reasoning ends: the reasoning's rest
        through its end (`</think>`) where the reply starts inside it, else an optional
        think block (after whitespace or not); then any whitespace. Where the end is a
        token the reasoning may hold any token but it and the end of the sequence; where
        it is text, text only."""
        end = literals.added.get(self.end)
        if end is None:
            text, rules = text_until(self.end, literals, "REASONING")
        else:
            excluded = ",".join(str(i) for i in sorted({end, *eos_token_ids}))
            text = f"reasoning <[{end}]>"
            rules = f"reasoning: (REASONING | <[^{excluded}]>)*\nREASONING: /(.|\\n)+/"
        block = f"{text} SPACE?"
        # GLM-4.5 opens its think block after a newline
        start = block if inside else f"(SPACE? {literals(self.start)} {block})?"
        return f"start: {start} @answer\n{rules}\nSPACE: /[ \\t\\r\\n]+/\n"


def reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r}: choose one of "
                         f"{', '.join(REASONING_PARSERS)}")
    if name == "mistral":
        return ReasoningParser(name, start=MISTRAL_START, end=MISTRAL_END)
    if name == "gemma4":
        return ReasoningParser(name, start=GEMMA4_START, end=GEMMA4_END)
    return ReasoningParser(name, always_starts_inside=name == "deepseek_r1")


def template_reasoning_parser(template: str) -> ReasoningParser | None:
    """The parser a chat template implies when none is named: `gemma4` for one that renders
    a `<channel|>` (Gemma 4), `mistral` for one that renders `[THINK]` (Magistral), `qwen3`
    for one that renders `<think>` or `</think>` (its model thinks in such blocks), else
    None."""
    if GEMMA4_END in template:
        return reasoning_parser("gemma4")
    if MISTRAL_START in template or MISTRAL_END in template:
        return reasoning_parser("mistral")
    return reasoning_parser("qwen3") if START in template or END in template else None


def _held(text: str, marker: str) -> int:
    """How many trailing characters of `text` may begin `marker`."""
    return max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


class ReasoningStream:
    """One reply's text split as it arrives: `feed` returns the (reasoning, content) a
    client may see now, holding back what may still be the start of a marker; `finish`
    returns the rest."""

    def __init__(self, parser: ReasoningParser, inside: bool) -> None:
        self.start, self.end = parser.start, parser.end
        self.inside = inside
        self.reasoned = inside  # the reply has reasoning (it may be empty)
        self.opening = True  # no non-space text yet: a `<think>` here opens reasoning
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        reasoning, content = "", ""
        while self.pending:
            if self.opening:
                stripped = self.pending.lstrip()
                if stripped.startswith(self.start):
                    self.inside = self.reasoned = True
                    self.pending = stripped[len(self.start):]
                    self.opening = False
                    continue
                if self.start.startswith(stripped):
                    break  # whitespace, or the start of `<think>`: wait
                self.opening = False
            if not self.inside:
                content, self.pending = content + self.pending, ""
                break
            end = self.pending.find(self.end)
            if end >= 0:
                reasoning += self.pending[:end]
                self.pending = self.pending[end + len(self.end):]
                self.inside = False
                continue
            keep = _held(self.pending, self.end)
            reasoning += self.pending[:len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning if the reply ended inside it, else content."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.inside else ("", rest)
