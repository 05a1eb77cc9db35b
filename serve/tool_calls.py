"""Tool calls in a model's output, by family: how each writes them (the parser
`lathe serve --tool-call-parser` picks), the grammar that makes a model write one when a
request's `tool_choice` requires it, and the split of a stream into the text a client may
see now and the calls it gets at the end.

- hermes (Qwen2.5, Qwen3, Hermes, SmolLM3): `<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>`, one block per call;
- llama3_json (Llama 3.1+): the reply is a JSON object `{"name": ..., "parameters": {...}}`
  (after `<|python_tag|>` or not), several separated by `;`;
- mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`.

Output that does not parse as calls stays text (vLLM does the same): a model that opens a
call and writes junk gets its junk back as content, never a crash.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lathe.serve.structured import StructuredOutput

PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _json_objects(text: str) -> list[Any] | None:
    """The JSON values `text` holds one after another (separated by whitespace or `;`)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError):
            return None
        values.append(value)


class ToolCallParser:
    """One family's tool-call format. `markers`: what opens the calls; with `at_start`
    only where the reply begins (after whitespace)."""

    name = ""
    markers: tuple[str, ...] = ()
    at_start = False
    arguments_key = "arguments"

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """The reply's text and its calls; ([text], []) when no call parses."""
        start = self.opening(text)
        if start is None:
            return text, []
        calls = self.parse_calls(text[start:])
        if not calls:
            return text, []
        return text[:start].rstrip(), calls

    def opening(self, text: str) -> int | None:
        """Where the calls begin in `text`, if they do."""
        if self.at_start:
            stripped = len(text) - len(text.lstrip())
            return stripped if text.lstrip().startswith(self.markers) else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` may be the start of a marker (kept from
        the stream until the next token decides)."""
        if self.at_start:
            return len(text) if not text.strip() or any(
                m.startswith(text.lstrip()) for m in self.markers) else 0
        return max((k for m in self.markers for k in range(1, len(m))
                    if text.endswith(m[:k])), default=0)

    def parse_calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def grammar(self, tools: list[dict[str, Any]], several: bool) -> StructuredOutput:
        """A Lark grammar (llguidance's, with `%json` schemas) whose every sentence is a
        well-formed call, or one or more with `several`, of one of `tools`, its arguments
        valid against the tool's parameters."""
        raise NotImplementedError

    def _call_schema(self, tools: list[dict[str, Any]]) -> str:
        options = [{"type": "object", "additionalProperties": False,
                    "required": ["name", self.arguments_key],
                    "properties": {"name": {"const": t["function"]["name"]},
                                   self.arguments_key: t["function"].get(
                                       "parameters") or {"type": "object"}}}
                   for t in tools]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        # compact JSON: a model may not pad a call with whitespace until max_tokens
        return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


class HermesParser(ToolCallParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def parse_calls(self, text: str) -> list[ToolCall]:
        calls, rest = [], text
        while rest.strip():
            rest = rest.lstrip()
            if not rest.startswith("<tool_call>"):
                return []  # text after the calls: the reply is not (only) calls
            body, closed, rest = rest[len("<tool_call>"):].partition("</tool_call>")
            values = _json_objects(body) if closed else None
            call = _call(values[0], "arguments") if values and len(values) == 1 else None
            if call is None:
                return []
            calls.append(call)
        return calls

    def grammar(self, tools: list[dict[str, Any]], several: bool) -> StructuredOutput:
        repeat = ' ("\\n" call)*' if several else ""
        return StructuredOutput(grammar=(
            f"start: call{repeat}\n"
            'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {self._call_schema(tools)}\n"))


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start = True
    arguments_key = "parameters"

    def parse_calls(self, text: str) -> list[ToolCall]:
        values = _json_objects(text.removeprefix("<|python_tag|>"))
        calls = [_call(v, "parameters") for v in values or []]
        return calls if calls and all(calls) else []

    def grammar(self, tools: list[dict[str, Any]], several: bool) -> StructuredOutput:
        repeat = ' ("; " call)*' if several else ""
        return StructuredOutput(grammar=(f"start: call{repeat}\n"
                                         f"call: %json {self._call_schema(tools)}\n"))


class MistralParser(ToolCallParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def parse_calls(self, text: str) -> list[ToolCall]:
        values = _json_objects(text.removeprefix("[TOOL_CALLS]"))
        if not values or len(values) != 1 or not isinstance(values[0], list):
            return []
        calls = [_call(v, "arguments") for v in values[0]]
        return calls if calls and all(calls) else []

    def grammar(self, tools: list[dict[str, Any]], several: bool) -> StructuredOutput:
        items = json.loads(self._call_schema(tools))
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "x-guidance": items.pop("x-guidance"), "items": items}
        if not several:
            array["maxItems"] = 1
        schema = json.dumps(array)
        return StructuredOutput(grammar=f'start: "[TOOL_CALLS]" calls\ncalls: %json {schema}\n')


def tool_call_parser(name: str) -> ToolCallParser:
    parsers = {"hermes": HermesParser, "llama3_json": Llama3JsonParser,
               "mistral": MistralParser}
    if name not in parsers:
        raise ValueError(f"--tool-call-parser {name!r}: choose one of {', '.join(PARSERS)}")
    return parsers[name]()


class ToolStream:
    """One streamed choice's text, split as it arrives: `feed` returns what the client may
    see now (nothing of a call, nor of what may yet open one); `finish` returns the rest
    of the text and the calls."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser, self.text, self.sent, self.in_calls = parser, "", 0, False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_calls:
            return ""
        start = self.parser.opening(self.text)
        if start is not None:
            self.in_calls = True
            out, self.sent = self.text[self.sent:start], start
            return out
        end = len(self.text) - self.parser.held_back(self.text)
        out, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self.parser.split(self.text)
        if calls:
            return content[self.sent:] if len(content) > self.sent else "", calls
        return self.text[self.sent:], []
