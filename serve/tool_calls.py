"""Tool calls in a model's output, by family: how each writes them (the parser
`lathe serve --tool-call-parser` picks), the grammar that makes a model write one when a
request's `tool_choice` requires it, and the split of a stream into the text a client may
see now and each call as soon as it is complete (`ToolStream`).

- hermes (Qwen2.5, Qwen3, Hermes, SmolLM3): `<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>`, one block per call;
- llama3_json (Llama 3.1+): the reply is a JSON object `{"name": ..., "parameters": {...}}`
  (after `<|python_tag|>` or not), several separated by `;`;
- mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (Mistral
  7B v0.3, Nemo, Small 3.1), or `[TOOL_CALLS]name[ARGS]{...}` per call (Mistral Small 3.2,
  Magistral, Devstral: templates that write `[ARGS]`); both are read, and a grammar writes
  the served template's; its templates take only call ids of 9 letters and digits, so its
  calls get such ids;
- qwen3_coder (Qwen3-Coder, Qwen3.5): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE
  \n</parameter>\n</function>\n</tool_call>`;
- glm45 (GLM-4.5, GLM-4.6): `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE
  </arg_value>\n</tool_call>`; glm47 (GLM-4.7) the same without the newlines;
- gemma4 (Gemma 4): `<|tool_call>call:NAME{key:VALUE,...}<tool_call|>` per call, a value
  in its template's own notation (`format_argument`): a string between `<|"|>` quotes
  (unescaped), objects `{key:value}` with bare keys, lists, and numbers, true, false and
  null as JSON writes them (null as None in its first templates); the turn ends at
  `<|tool_response>`, which may follow.

In the last three a value is text: a parameter the tool's schema types as a string is its
text as written, any other is read as JSON (Qwen's templates write Python's `True`,
`False` and `None` for scalars, which read as JSON's), and one the schema does not name
stays text, as vLLM's parsers read them; so these parsers are bound to a request's tools
(`for_tools`). A forcing grammar writes a string value as free text up to its closing
marker, an enum's as one of its values, a boolean or null as JSON or Python spells it,
any other as JSON valid against its schema.

A grammar spells each marker as the tokenizer does (`structured.Literals`): Qwen's
`<tool_call>` and Mistral's `[TOOL_CALLS]` are added tokens, which the matcher takes only
as tokens. Forcing admits at most `max_calls` calls; a reply cut by max_tokens keeps the
calls it completed and drops the one it was writing (vLLM does the same). A tool marked
`strict` gets OpenAI's strict semantics: no object in its arguments takes keys beyond its
properties. Calls are read one after another from the first marker: output that does not
parse as a call stays text (vLLM does the same) — a model that opens a call and writes junk
gets its junk back as content, never a crash — and so does whatever follows the last complete
call (text after the calls, a malformed one), the calls before it kept, as vLLM's streaming
parsers keep them. A call never reads differently in a longer text, so a stream hands each
out once it is complete and the whole reply reads the same.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

from lathe.serve.structured import Literals, StructuredOutput, text_until

# while the text after the last call read is no longer than this, a stream reads on each
# piece (text that ends the calls shows at once); past it, where a call's end may have come
SHORT_TAIL = 64
PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder", "glm45", "glm47", "gemma4")
_SPACE = re.compile(r"\s*")


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


class CallsRead(NamedTuple):
    """What `ToolCallParser.read_calls` read: the complete calls, where the text after
    them begins, and whether that text may still become a call."""

    calls: list[ToolCall]
    end: int
    pending: bool


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
    ends: tuple[str, ...] = ()  # what a call's text may end with (a stream reads then)
    turn_end = ""  # what may follow the calls to end the turn (not text)
    at_start = False
    arguments_key = "arguments"
    schemas: dict[str, Any] = {}  # a bound request's tools: name -> parameters schema

    def for_tools(self, tools: list[dict[str, Any]]) -> ToolCallParser:
        """This parser reading the calls of one request's (normalized) `tools`."""
        bound = copy.copy(self)
        bound.schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                         for t in tools}
        return bound

    def for_template(self, template: str) -> ToolCallParser:
        """This parser for a model served with chat `template` (where a family's templates
        write calls in more than one way)."""
        return self

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
        """The reply's text and its calls; ([text], []) when no call parses. The calls are
        read one after another from the first marker; what follows the last complete one
        (text, a malformed call) is text again. `truncated`: the reply was cut
        (max_tokens), so a last call left unfinished is dropped, not text."""
        start = self.opening(text)
        if start is None:
            return text, []
        read = self.read_calls(text[start:])
        if not read.calls:
            return text, []
        return (text[:start] + self.after_calls(text[start + read.end:], read.pending,
                                                truncated)).rstrip(), read.calls

    def after_calls(self, text: str, pending: bool, truncated: bool) -> str:
        """The reply's text after its last complete call, as the client gets it: none where
        the reply was cut inside a call, or where it is what ends a turn of calls."""
        if pending and (truncated or (self.turn_end and text.strip() == self.turn_end)):
            return ""
        return text

    def opening(self, text: str) -> int | None:
        """Where the calls begin in `text`, if they do."""
        if self.at_start:
            stripped = _SPACE.match(text).end()
            return stripped if text.startswith(self.markers, stripped) else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` may be the start of a marker (kept from
        the stream until the next token decides)."""
        if self.at_start:
            head = text[_SPACE.match(text).end():]
            return len(text) if any(m.startswith(head) for m in self.markers) else 0
        return max((k for m in self.markers for k in range(1, len(m))
                    if text.endswith(m[:k])), default=0)

    def read_calls(self, text: str, at: int = 0) -> CallsRead:
        """The complete calls `text` (from the first marker on) holds one after another
        from `at` (the end of calls already read), where the text after them begins, and
        whether that text may yet become a call as more arrives (a call cut short, or
        nothing) rather than being text. Reading a longer text never reads a call of
        the shorter one differently: a stream hands each call out once it is complete."""
        raise NotImplementedError

    def grammar(self, tools: list[dict[str, Any]], max_calls: int,
                literals: Literals) -> StructuredOutput:
        """A Lark grammar (llguidance's, with `%json` schemas) whose every sentence is one
        to `max_calls` well-formed calls of `tools`, their arguments valid against the
        tool's parameters, markers spelled by `literals`."""
        raise NotImplementedError

    def _json_calls(self, text: str, at: int, separators: str,
                    closing: str | None = None) -> CallsRead:
        """Calls written as JSON objects from `at`, `separators` between them, until
        `closing` (a list's `]`: read past it) when one is given."""
        decoder, calls = json.JSONDecoder(), []
        while True:
            start = at
            while start < len(text) and text[start] in separators:
                start += 1
            if start == len(text):
                return CallsRead(calls, at, True)
            if closing is not None and text.startswith(closing, start):
                end = start + len(closing)  # what follows the closed list is text
                return CallsRead(calls, end, not text[end:].strip())
            try:
                value, end = decoder.raw_decode(text, start)
            except (json.JSONDecodeError, RecursionError):
                return CallsRead(calls, at, True)  # cut short, or never JSON: the end says
            call = self.call(value)
            if call is None:
                return CallsRead(calls, at, False)
            calls.append(call)
            at = end

    def _call_schema(self, tools: list[dict[str, Any]]) -> str:
        options = [{"type": "object", "additionalProperties": False,
                    "required": ["name", self.arguments_key],
                    "properties": {"name": {"const": t["function"]["name"]},
                                   self.arguments_key: arguments_schema(t["function"])}}
                   for t in tools]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return tojson_schema(schema)


def arguments_schema(function: dict[str, Any]) -> Any:
    """The schema a call's arguments must meet (strict: no keys beyond the properties)."""
    schema = function.get("parameters") or {"type": "object"}
    return strict_schema(schema) if function.get("strict") else schema


def tojson_schema(schema: Any) -> str:
    """`schema` for a grammar's `%json`, spaced as the templates' `tojson` (Python's
    `json.dumps`) writes it and in no other way: a model may not pad a call with whitespace
    until max_tokens."""
    return json.dumps({**schema, "x-guidance": {
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}})


def _repeat(call: str, separator: str, max_calls: int) -> str:
    return f"{call} ({separator} {call}){{0,{max_calls - 1}}}" if max_calls > 1 else call


class HermesParser(ToolCallParser):
    name = "hermes"
    markers = ("<tool_call>",)
    ends = ("</tool_call>",)

    def read_calls(self, text: str, at: int = 0) -> CallsRead:
        calls = []
        while True:
            rest = text[at:].lstrip()
            if not rest.startswith("<tool_call>"):  # text, or the next marker cut short
                return CallsRead(calls, at, "<tool_call>".startswith(rest))
            body, closed, after = rest[len("<tool_call>"):].partition("</tool_call>")
            if not closed:
                return CallsRead(calls, at, True)
            read = self._json_calls(body, 0, " \t\r\n")  # one call, alone in its block
            call = read.calls[0] if len(read.calls) == 1 and not body[read.end:].strip() \
                else None
            if call is None:
                return CallsRead(calls, at, False)
            calls.append(call)
            at = len(text) - len(after)

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
    ends = ("}",)
    at_start = True
    arguments_key = "parameters"

    def read_calls(self, text: str, at: int = 0) -> CallsRead:
        if at == 0 and text.startswith("<|python_tag|>"):
            read = self._json_calls(text, len("<|python_tag|>"), " \t\r\n;")
            return read if read.calls else CallsRead([], 0, read.pending)
        return self._json_calls(text, at, " \t\r\n;")

    def grammar(self, tools: list[dict[str, Any]], max_calls: int,
                literals: Literals) -> StructuredOutput:
        return StructuredOutput(grammar=(f"start: {_repeat('call', literals('; '), max_calls)}\n"
                                         f"call: %json {self._call_schema(tools)}\n"))


class MistralParser(ToolCallParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    ends = ("}", "]")
    named_args = False  # a grammar writes [TOOL_CALLS]name[ARGS]{...}, not a JSON list

    def for_template(self, template: str) -> ToolCallParser:
        bound = copy.copy(self)
        bound.named_args = "[ARGS]" in template
        return bound

    def new_id(self) -> str:
        """Mistral's templates refuse any call id but 9 letters and digits."""
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))

    def read_calls(self, text: str, at: int = 0) -> CallsRead:
        body = text[len("[TOOL_CALLS]"):] if text.startswith("[TOOL_CALLS]") else ""
        if not body.lstrip().startswith("["):
            return self._named_calls(text, at)
        if at:
            if text[at - 1] == "]":  # the list closed (a call ends with "}"): text after it
                return CallsRead([], at, not text[at:].strip())
            return self._json_calls(text, at, " \t\r\n,", closing="]")
        read = self._json_calls(text, len(text) - len(body.lstrip()) + 1, " \t\r\n,",
                                closing="]")  # into the list
        return read if read.calls else CallsRead([], 0, read.pending)

    def _named_calls(self, text: str, at: int) -> CallsRead:
        """`[TOOL_CALLS]name[ARGS]{...}` calls, one after another (a `[CALL_ID]id` before
        `[ARGS]`, as some of Mistral's tokenizers write, is read past)."""
        calls, decoder = [], json.JSONDecoder()
        while True:
            rest = text[at:].lstrip()
            if not rest.startswith("[TOOL_CALLS]"):
                return CallsRead(calls, at, "[TOOL_CALLS]".startswith(rest))
            head, found, rest = rest[len("[TOOL_CALLS]"):].partition("[ARGS]")
            name = head.partition("[CALL_ID]")[0]
            try:
                arguments, end = decoder.raw_decode(rest) if found else (None, 0)
            except (json.JSONDecodeError, RecursionError):
                arguments, end = None, 0
            call = self.call({"name": name, "arguments": arguments}) \
                if found and re.fullmatch(r"[\w.-]+", name) and arguments is not None else None
            if call is None:  # cut inside this call (where it is not, the end says)
                return CallsRead(calls, at, True)
            calls.append(call)
            at = len(text) - len(rest) + end

    def grammar(self, tools: list[dict[str, Any]], max_calls: int,
                literals: Literals) -> StructuredOutput:
        if self.named_args:
            rules = [f"call_{i}: {literals('[TOOL_CALLS]' + t['function']['name'] + '[ARGS]')}"
                     f" %json {tojson_schema(arguments_schema(t['function']))}"
                     for i, t in enumerate(tools)]
            return StructuredOutput(grammar=(
                f"start: call{{1,{max_calls}}}\n"
                f"call: {' | '.join(f'call_{i}' for i in range(len(tools)))}\n"
                + "\n".join(rules) + "\n"))
        items = json.loads(self._call_schema(tools))
        array: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": max_calls,
                                 "x-guidance": items.pop("x-guidance"), "items": items}
        return StructuredOutput(grammar=f"start: {literals('[TOOL_CALLS]')} calls\n"
                                        f"calls: %json {json.dumps(array)}\n")


def _types(schema: Any) -> set[str]:
    """The JSON types `schema` admits, as far as its `type`, `enum`, `const` and
    `anyOf`/`oneOf` say (empty: it does not say)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    values = schema["enum"] if isinstance(schema.get("enum"), list) else \
        [schema["const"]] if "const" in schema else None
    if values:
        return {"string" if isinstance(v, str) else "other" for v in values}
    options = schema.get("anyOf", schema.get("oneOf"))
    return set().union(*(_types(o) for o in options)) if isinstance(options, list) else set()


def typed_value(text: str, schema: Any) -> Any:
    """A parameter written as text, as its schema types it: itself for a string (and for a
    parameter the tool does not name), JSON for anything else, Python's spellings of
    true, false and null (Qwen's templates write scalars with `| string`) as JSON's; text
    that does not read as JSON stays text."""
    if schema is None:
        return text
    kinds, word = _types(schema), text.strip()
    if "null" in kinds and word in ("null", "None"):
        return None
    if "string" in kinds:
        return text
    if "boolean" in kinds and word.lower() in ("true", "false"):
        return word.lower() == "true"
    if "null" in kinds or not kinds:
        word = {"None": "null", "True": "true", "False": "false"}.get(word, word)
    try:
        return json.loads(word)
    except (json.JSONDecodeError, RecursionError):
        return text


def _flexible(text: str) -> str:
    """A regex of written marker text where each newline may be any whitespace."""
    return r"\s*".join(re.escape(part) for part in text.split("\n"))


@dataclass(frozen=True)
class XmlForm:
    """How a family writes a call in markup, `{name}` and `{key}` where the function's and
    a parameter's names go: the call's head, each argument's head (its value after it) and
    tail, the call's tail, and what goes between calls."""

    call_head: str
    arg_head: str
    arg_tail: str
    call_tail: str
    separator: str

    @functools.cached_property
    def readers(self) -> tuple[re.Pattern, re.Pattern, re.Pattern, re.Pattern]:
        """The regexes that read it back (built once a form): the call's head (its name),
        an argument's head (its key), what may follow a value's closing marker, the
        call's tail."""
        before_name, after_name = self.call_head.split("{name}")
        before_key, after_key = self.arg_head.split("{key}")
        return (re.compile(_flexible(before_name) + r"\s*([\w.-]+)" + _flexible(after_name)),
                re.compile(r"\s*" + _flexible(before_key) + r"\s*([^\s<>]+?)\s*"
                           + _flexible(after_key.rstrip("\n"))
                           + ("\n?" if after_key.endswith("\n") else "")),
                re.compile(r"\s*(?:" + re.escape(before_key.strip()) + "|"
                           + re.escape(self.call_tail.strip().split("\n")[0]) + ")"),
                re.compile(r"\s*" + _flexible(self.call_tail.strip())))


class XmlToolCallParser(ToolCallParser):
    """Calls written as markup, each argument's value as text (`XmlForm`), read back with
    each newline of the markers as any whitespace; a value ends at the first closing
    marker that the next argument or the call's end follows."""

    markers = ("<tool_call>",)
    ends = ("</tool_call>",)
    form: XmlForm

    def read_calls(self, text: str, at: int = 0) -> CallsRead:
        form = self.form
        head, arg, next_part, tail = form.readers
        close = form.arg_tail.strip()
        calls = []
        while True:
            start = len(text) - len(text[at:].lstrip())
            match = head.match(text, start)
            if match is None:  # not a call; or, cut short, the head of the next one
                rest = text[start:]
                return CallsRead(calls, at, rest.startswith("<tool_call>")
                                 or "<tool_call>".startswith(rest))
            name, position, arguments = match.group(1), match.end(), {}
            properties = (self.schemas.get(name) or {}).get("properties") or {}
            while (key := arg.match(text, position)) is not None:
                end = key.end()
                while (end := text.find(close, end)) >= 0 \
                        and not next_part.match(text, end + len(close)):
                    end += 1
                if end < 0:
                    return CallsRead(calls, at, True)
                value = text[key.end():end]
                if form.arg_tail.startswith("\n"):
                    value = value.removesuffix("\n")
                arguments[key.group(1)] = typed_value(value, properties.get(key.group(1)))
                position = end + len(close)
            ended = tail.match(text, position)
            if ended is None:
                return CallsRead(calls, at, True)
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False),
                                  self.new_id()))
            at = ended.end()

    def grammar(self, tools: list[dict[str, Any]], max_calls: int,
                literals: Literals) -> StructuredOutput:
        form, rules, calls = self.form, [], []
        text_value, text_lexeme = text_until(form.arg_tail, literals, "TEXT")
        for i, tool in enumerate(tools):
            function = tool["function"]
            schema = arguments_schema(function)
            required = set(schema.get("required", []))
            parts = []
            for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
                rules.append(f"arg_{i}_{j}: {literals(form.arg_head.format(key=key))} "
                             f"{self._value(sub, schema, literals, text_value)}")
                parts.append(f"arg_{i}_{j}" + ("" if key in required else "?"))
            head = literals(form.call_head.format(name=function["name"]))
            rules.append(f"call_{i}: {' '.join([head, *parts, literals(form.call_tail)])}")
            calls.append(f"call_{i}")
        separator = literals(form.separator) if form.separator else None
        start = _repeat("call", separator, max_calls) if separator else \
            f"call{{1,{max_calls}}}"
        return StructuredOutput(grammar="\n".join([
            f"start: {start}", f"call: {' | '.join(calls)}", *rules, text_lexeme, ""]))

    def _value(self, schema: Any, parameters: dict[str, Any], literals: Literals,
               text_value: str) -> str:
        """A parameter's value and the argument's tail, as a Lark sequence."""
        tail = literals(self.form.arg_tail)
        kinds = _types(schema)
        values = schema.get("enum") if isinstance(schema, dict) else None
        if kinds == {"string"} and isinstance(values, list):
            return f"({' | '.join(json.dumps(v) for v in values)}) {tail}"
        if "string" in kinds or not kinds:
            return text_value
        if kinds <= {"boolean", "null"}:  # as JSON or as Python writes them
            words = (["true", "false", "True", "False"] if "boolean" in kinds else []) + \
                (["null", "None"] if "null" in kinds else [])
            return f"({' | '.join(json.dumps(w) for w in words)}) {tail}"
        shared = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
        return f"%json {tojson_schema({**shared, **schema})} {tail}"


class Qwen3CoderParser(XmlToolCallParser):
    name = "qwen3_coder"
    form = XmlForm("<tool_call>\n<function={name}>\n", "<parameter={key}>\n",
                   "\n</parameter>\n", "</function>\n</tool_call>", "\n")


class Glm45Parser(XmlToolCallParser):
    name = "glm45"
    form = XmlForm("<tool_call>{name}\n", "<arg_key>{key}</arg_key>\n<arg_value>",
                   "</arg_value>\n", "</tool_call>", "\n")


class Glm47Parser(XmlToolCallParser):
    name = "glm47"
    form = XmlForm("<tool_call>{name}", "<arg_key>{key}</arg_key><arg_value>",
                   "</arg_value>", "</tool_call>", "")


GEMMA_QUOTE = '<|"|>'
GEMMA_MAX_DEPTH = 64  # nested arguments deeper than this are not a call (hostile output)
_GEMMA_SCALAR = re.compile(r"[^,:{}\[\]<]+")
_GEMMA_KEY = re.compile(r"[^,:{}\[\]<]+(?=:)")
_GEMMA_HEAD = re.compile(r"<\|tool_call>call:([\w.-]+)\{")


def gemma_value(text: str, at: int, depth: int = 0) -> tuple[Any, int]:
    """The Gemma 4 argument value at `text[at:]` and where it ends; ValueError when none is
    there."""
    if depth > GEMMA_MAX_DEPTH:
        raise ValueError("arguments nested too deep")
    if text.startswith(GEMMA_QUOTE, at):
        end = text.find(GEMMA_QUOTE, at + len(GEMMA_QUOTE))
        if end < 0:
            raise ValueError("unclosed string")
        return text[at + len(GEMMA_QUOTE):end], end + len(GEMMA_QUOTE)
    if text.startswith(("{", "["), at):
        mapping, close = text[at] == "{", "}" if text[at] == "{" else "]"
        items: Any = {} if mapping else []
        at += 1
        while not text.startswith(close, at):
            if items:
                if not text.startswith(",", at):
                    raise ValueError("expected a comma")
                at += 1
            if mapping:
                key, at = gemma_key(text, at)
                items[key], at = gemma_value(text, at + 1, depth + 1)
            else:
                value, at = gemma_value(text, at, depth + 1)
                items.append(value)
        return items, at + 1
    word = _GEMMA_SCALAR.match(text, at)
    if word is None:
        raise ValueError("expected a value")
    try:  # the first Gemma 4 templates wrote None as Python does
        value = json.loads({"None": "null"}.get(word.group().strip(), word.group()))
    except json.JSONDecodeError:
        raise ValueError(f"not a value: {word.group()!r}") from None
    if isinstance(value, str):
        raise ValueError("a string must be quoted")
    return value, word.end()


def gemma_key(text: str, at: int) -> tuple[str, int]:
    """A key of a Gemma 4 object (bare, or quoted as some of its templates write nested
    ones) and where its `:` is."""
    if text.startswith(GEMMA_QUOTE, at):
        key, at = gemma_value(text, at)
    else:
        found = _GEMMA_KEY.match(text, at)
        if found is None:
            raise ValueError("expected a key")
        key, at = found.group(), found.end()
    if not text.startswith(":", at):
        raise ValueError("expected a colon")
    return key, at


class Gemma4Parser(ToolCallParser):
    name = "gemma4"
    markers = ("<|tool_call>",)
    closing = "<tool_call|>"
    turn_end = "<|tool_response>"
    ends = (closing, turn_end)

    def read_calls(self, text: str, at: int = 0) -> CallsRead:
        calls = []
        while True:
            start = len(text) - len(text[at:].lstrip())
            rest = text[start:]
            if self.turn_end.startswith(rest):  # the turn's end, whole or cut short
                return CallsRead(calls, at, True)
            head = _GEMMA_HEAD.match(text, start)
            if head is None:  # text; or, cut short, a call's head
                return CallsRead(calls, at, rest.startswith(self.markers[0])
                                 or self.markers[0].startswith(rest))
            try:
                arguments, end = gemma_value(text, head.end() - 1)
            except (ValueError, RecursionError):  # cut short, or never a value: the end says
                return CallsRead(calls, at, True)
            if not text.startswith(self.closing, end):
                return CallsRead(calls, at, self.closing.startswith(text[end:]))
            calls.append(ToolCall(head.group(1), json.dumps(arguments, ensure_ascii=False),
                                  self.new_id()))
            at = end + len(self.closing)

    def grammar(self, tools: list[dict[str, Any]], max_calls: int,
                literals: Literals) -> StructuredOutput:
        text, text_lexeme = text_until(GEMMA_QUOTE, literals, "TEXT")
        quote = literals(GEMMA_QUOTE)
        rules, calls = [], []
        for i, tool in enumerate(tools):
            function = tool["function"]
            schema = arguments_schema(function)
            required = set(schema.get("required", []))
            # the template writes the keys sorted (`dictsort`)
            parts = sorted((key, sub, key in required)
                           for key, sub in (schema.get("properties") or {}).items())
            for j, (key, sub, _) in enumerate(parts):
                rules.append(f"arg_{i}_{j}: {literals(key + ':')} "
                             f"{self._value(sub, quote, text, literals)}")
            args = self._arguments([(f"arg_{i}_{j}", needed)
                                    for j, (_, _, needed) in enumerate(parts)], literals(","))
            head = literals(f"<|tool_call>call:{function['name']}{{")
            rules.append(f"call_{i}: {head} {args} {literals('}' + self.closing)}")
            calls.append(f"call_{i}")
        return StructuredOutput(grammar="\n".join([
            f"start: call{{1,{max_calls}}}", f"call: {' | '.join(calls)}", *rules,
            f"value: {quote} {text} | NUMBER | {literals('true')} | {literals('false')} "
            f"| {literals('null')} | {literals('None')} "
            f"| {literals('{')} (pair ({literals(',')} pair)*)? {literals('}')} "
            f"| {literals('[')} (value ({literals(',')} value)*)? {literals(']')}",
            f"pair: KEY {literals(':')} value", "KEY: /[A-Za-z_][A-Za-z0-9_]*/",
            r"NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/", text_lexeme, ""]))

    @staticmethod
    def _arguments(args: list[tuple[str, bool]], comma: str) -> str:
        """The arguments in order, each optional one left out or not, commas between those
        written: as a Lark sequence (`""` for none)."""
        def after(k: int) -> str:  # args[k:], something written before them
            if k == len(args):
                return ""
            name, needed = args[k]
            return f"{comma} {name} {after(k + 1)}" if needed else \
                f"({comma} {name})? {after(k + 1)}"

        def first(k: int) -> str:  # args[k:], nothing written before them
            if k == len(args):
                return ""
            name, needed = args[k]
            if needed:
                return f"{name} {after(k + 1)}"
            rest = first(k + 1)
            return f"({name} {after(k + 1)} | {rest})" if rest else f"{name}?"
        return first(0)

    @staticmethod
    def _value(schema: Any, quote: str, text: str, literals: Literals) -> str:
        """A parameter's value as its schema types it, in Gemma's notation: where that is
        JSON's (numbers, true, false, null, and lists of them) valid against the schema,
        else a string or any value."""
        kinds = _types(schema)
        values = schema.get("enum") if isinstance(schema, dict) else None
        if kinds == {"string"} and isinstance(values, list):
            return f"{quote} ({' | '.join(json.dumps(v) for v in values)}) {quote}"
        if kinds == {"string"}:
            return f"{quote} {text}"
        if _json_spelled(schema):
            return "%json " + json.dumps({**schema, "x-guidance": {
                "whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}})
        return "value"


def _json_spelled(schema: Any) -> bool:
    """Whether every value `schema` admits is written alike in JSON and in Gemma 4's
    notation: numbers, booleans, null, and lists of them."""
    kinds = _types(schema)
    if not kinds or not kinds <= {"integer", "number", "boolean", "null", "array"}:
        return False
    return "array" not in kinds or _json_spelled(schema.get("items"))


def template_tool_call_parser(template: str) -> ToolCallParser | None:
    """The parser whose format a chat template writes calls in, when none is named (as
    llama.cpp's server reads it off the template): Gemma 4's `<|tool_call>`, GLM's
    `<arg_key>` (glm47 where a value follows its key at once), Qwen3-Coder's `<function=`,
    Mistral's `[TOOL_CALLS]`, Hermes' `<tool_call>` JSON, Llama 3.1's `"parameters"` JSON;
    None for a template that writes none of them."""
    if "<|tool_call>" in template:
        name = "gemma4"
    elif "<arg_key>" in template:
        name = "glm47" if "</arg_key><arg_value>" in template else "glm45"
    elif "<function=" in template:
        name = "qwen3_coder"
    elif "[TOOL_CALLS]" in template:
        name = "mistral"
    elif "<tool_call>" in template:
        name = "hermes"
    elif "<|python_tag|>" in template or ('"parameters": ' in template
                                          and "<|start_header_id|>" in template):
        name = "llama3_json"
    else:
        return None
    return tool_call_parser(name).for_template(template)


def tool_call_parser(name: str) -> ToolCallParser:
    parsers = {parser.name: parser for parser in (
        HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser, Glm45Parser,
        Glm47Parser, Gemma4Parser)}
    if name not in parsers:
        raise ValueError(f"--tool-call-parser {name!r}: choose one of {', '.join(PARSERS)}")
    return parsers[name]()


class ToolStream:
    """One streamed choice's text, split as it arrives: `feed` returns the text the client
    may see now (nothing of a call, nor of what may yet open one) and each call as soon as
    it is complete; `finish` returns the rest of the text and the last calls — together what
    `ToolCallParser.split` reads from the whole text. Before the first marker only the text
    not yet sent is searched for one (what may start one is held back); after it, the calls
    are read again only when a call's end may have arrived (`ToolCallParser.ends`) or while
    the text after the last call is short (where text that ends the calls shows), each read
    from the last call's end: a long reply costs its length about once, a long call a few
    times its length."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.sent = False  # whether the client was given text before the calls
        self.held = ""  # what may still open calls
        self.region: list[str] | None = None  # the text from the first marker on, in pieces
        self.size = 0  # its length
        self.end = 0  # where in it the calls handed out end
        self.called = 0  # how many were handed out
        self.passing = False  # the calls ended in text: the rest of the reply is text
        self.tail = ""  # the region's last characters, where a closing marker may begin
        self.keep = max(len(end) for end in parser.ends) - 1  # how many of them
        self.closed_read = 0  # the region's length at the last read on a closing marker

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self.passing:
            return delta, []
        if self.region is not None:
            return self._more(delta)
        self.held += delta
        if self.parser.at_start and self.sent:  # the reply began with text: no calls
            out, self.held, self.passing = self.held, "", True
            return out, []
        start = self.parser.opening(self.held)
        if start is None:
            end = len(self.held) - self.parser.held_back(self.held)
            out, self.held = self.held[:end], self.held[end:]
            self.sent = self.sent or bool(out)
            return out, []
        out, region, self.held = self.held[:start], self.held[start:], ""
        self.region = []
        rest, calls = self._more(region, force=True)
        return out + rest, calls

    def _more(self, delta: str, force: bool = False) -> tuple[str, list[ToolCall]]:
        assert self.region is not None
        self.region.append(delta)
        self.size += len(delta)
        window = self.tail + delta
        self.tail = window[len(window) - self.keep:] if self.keep else ""
        pending = self.size - self.end
        # past a short tail, a read on a closing marker waits until the call has grown by a
        # quarter since the last such read: a long JSON call's every "}" would read it all
        closing = self.size - self.closed_read >= pending // 4 \
            and any(end in window for end in self.parser.ends)
        if not (force or pending <= SHORT_TAIL or closing):
            return "", []
        if closing:
            self.closed_read = self.size
        region = "".join(self.region)
        self.region = [region]
        read = self.parser.read_calls(region, self.end)
        self.end = read.end
        self.called += len(read.calls)
        if read.pending:
            return "", read.calls
        self.passing = True  # text after the calls, or no call at all: text from there
        return region[read.end if self.called else 0:], read.calls

    def finish(self, truncated: bool = False) -> tuple[str, list[ToolCall]]:
        if self.passing:
            return "", []
        if self.region is None:
            return self.held, []
        region = "".join(self.region)
        read = self.parser.read_calls(region, self.end)
        if not self.called and not read.calls:
            return region, []
        return self.parser.after_calls(region[read.end:], read.pending, truncated), read.calls
