"""Tool calls in a model's output, by family: how each writes them (the parser
`lathe serve --tool-call-parser` picks), the grammar that makes a model write one when a
request's `tool_choice` requires it, and the split of a stream into the text a client may
see now and the calls it gets at the end.

- hermes (Qwen2.5, Qwen3, Hermes, SmolLM3): `<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>`, one block per call;
- llama3_json (Llama 3.1+): the reply is a JSON object `{"name": ..., "parameters": {...}}`
  (after `<|python_tag|>` or not), several separated by `;`;
- mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`; its
  templates take only call ids of 9 letters and digits, so its calls get such ids.

A grammar spells each marker as the tokenizer does (`structured.Literals`): Qwen's
`<tool_call>` and Mistral's `[TOOL_CALLS]` are added tokens, which the matcher takes only
as tokens. Forcing admits at most `max_calls` calls; a reply cut by max_tokens keeps the
calls it completed and drops the one it was writing (vLLM does the same). A tool marked
`strict` gets OpenAI's strict semantics: no object in its arguments takes keys beyond its
properties. Output that does not parse as calls stays text (vLLM does the same): a model
that opens a call and writes junk gets its junk back as content, never a crash.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from lathe.serve.structured import Literals, StructuredOutput

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


def _json_values(text: str, separators: str) -> tuple[list[Any], str]:
    """The JSON values at the head of `text`, one after another with `separators` between
    them, and the rest of `text` from the first that does not parse ("" when all do)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in separators:
            at += 1
        if at == len(text):
            return values, ""
        try:
            value, at = decoder.raw_decode(text, at)
        except (json.JSONDecodeError, RecursionError):
            return values, text[at:]
        values.append(value)


def strict_schema(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not
    set it (OpenAI's `strict: true`), through properties, items, combinators and $defs."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: strict_schema(value) if key not in ("properties", "$defs", "definitions",
                                                       "patternProperties")
              else {name: strict_schema(sub) for name, sub in value.items()}
              if isinstance(value, dict) else value for key, value in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) \
            and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


class ToolCallParser:
    """One family's tool-call format. `markers`: what opens the calls; with `at_start`
    only where the reply begins (after whitespace)."""

    name = ""
    markers: tuple[str, ...] = ()
    at_start = False
    arguments_key = "arguments"

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def call(self, obj: Any) -> ToolCall | None:
        """The call `obj` (a parsed JSON value) spells, if it is one."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get(self.arguments_key, {})
        if not isinstance(arguments, dict):
            return None
        return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False), self.new_id())

    def split(self, text: str, truncated: bool = False) -> tuple[str, list[ToolCall]]:
        """The reply's text and its calls; ([text], []) when no call parses. `truncated`:
        the reply was cut (max_tokens), so a last call left unfinished is dropped and the
        complete ones before it kept."""
        start = self.opening(text)
        if start is None:
            return text, []
        calls = self.parse_calls(text[start:], truncated)
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

    def parse_calls(self, text: str, truncated: bool) -> list[ToolCall]:
        """The calls `text` (from the first marker on) holds; [] unless it is calls only
        (but for an unfinished last one when `truncated`)."""
        raise NotImplementedError

    def grammar(self, tools: list[dict[str, Any]], max_calls: int,
                literals: Literals) -> StructuredOutput:
        """A Lark grammar (llguidance's, with `%json` schemas) whose every sentence is one
        to `max_calls` well-formed calls of `tools`, their arguments valid against the
        tool's parameters, markers spelled by `literals`."""
        raise NotImplementedError

    def _calls(self, values: list[Any]) -> list[ToolCall]:
        calls = [self.call(v) for v in values]
        return calls if calls and all(calls) else []

    def _call_schema(self, tools: list[dict[str, Any]]) -> str:
        def arguments(function: dict[str, Any]) -> Any:
            schema = function.get("parameters") or {"type": "object"}
            return strict_schema(schema) if function.get("strict") else schema
        options = [{"type": "object", "additionalProperties": False,
                    "required": ["name", self.arguments_key],
                    "properties": {"name": {"const": t["function"]["name"]},
                                   self.arguments_key: arguments(t["function"])}}
                   for t in tools]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        # compact JSON: a model may not pad a call with whitespace until max_tokens
        return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def _repeat(call: str, separator: str, max_calls: int) -> str:
    return f"{call} ({separator} {call}){{0,{max_calls - 1}}}" if max_calls > 1 else call


class HermesParser(ToolCallParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def parse_calls(self, text: str, truncated: bool) -> list[ToolCall]:
        calls, rest = [], text
        while rest.strip():
            rest = rest.lstrip()
            if not rest.startswith("<tool_call>"):
                if truncated and "<tool_call>".startswith(rest):
                    break  # cut inside the next call's marker
                return []  # text after the calls: the reply is not (only) calls
            body, closed, rest = rest[len("<tool_call>"):].partition("</tool_call>")
            if not closed and truncated:
                break
            values, junk = _json_values(body, " \t\r\n") if closed else ([], body)
            call = self.call(values[0]) if len(values) == 1 and not junk else None
            if call is None:
                return []
            calls.append(call)
        return calls

    def grammar(self, tools: list[dict[str, Any]], max_calls: int,
                literals: Literals) -> StructuredOutput:
        return StructuredOutput(grammar=(
            f"start: {_repeat('call', literals(chr(10)), max_calls)}\n"
            f"call: {literals('<tool_call>' + chr(10))} body "
            f"{literals(chr(10) + '</tool_call>')}\n"
            f"body: %json {self._call_schema(tools)}\n"))


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start = True
    arguments_key = "parameters"

    def parse_calls(self, text: str, truncated: bool) -> list[ToolCall]:
        values, rest = _json_values(text.removeprefix("<|python_tag|>"), " \t\r\n;")
        return self._calls(values) if not rest or truncated else []

    def grammar(self, tools: list[dict[str, Any]], max_calls: int,
                literals: Literals) -> StructuredOutput:
        return StructuredOutput(grammar=(f"start: {_repeat('call', literals('; '), max_calls)}\n"
                                         f"call: %json {self._call_schema(tools)}\n"))


class MistralParser(ToolCallParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def new_id(self) -> str:
        """Mistral's templates refuse any call id but 9 letters and digits."""
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))

    def parse_calls(self, text: str, truncated: bool) -> list[ToolCall]:
        body = text.removeprefix("[TOOL_CALLS]").lstrip()
        if not body.startswith("["):
            return []
        values, rest = _json_values(body[1:], " \t\r\n,")
        return self._calls(values) if rest.strip() == "]" or truncated else []

    def grammar(self, tools: list[dict[str, Any]], max_calls: int,
                literals: Literals) -> StructuredOutput:
        items = json.loads(self._call_schema(tools))
        array: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": max_calls,
                                 "x-guidance": items.pop("x-guidance"), "items": items}
        return StructuredOutput(grammar=f"start: {literals('[TOOL_CALLS]')} calls\n"
                                        f"calls: %json {json.dumps(array)}\n")


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

    def finish(self, truncated: bool = False) -> tuple[str, list[ToolCall]]:
        content, calls = self.parser.split(self.text, truncated)
        if calls:
            return content[self.sent:] if len(content) > self.sent else "", calls
        return self.text[self.sent:], []
