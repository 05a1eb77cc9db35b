"""OpenAI request bodies (pydantic) and the response and chunk JSON the server sends.

Field names and defaults follow OpenAI's API (completions default to 16 tokens, chat to
the rest of the context window; a null field means its default); vLLM's extras are taken
with vLLM's meaning (docs/openai-api.md lists every field and lathe's answer): top_k,
min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens, bad_words,
allowed_token_ids, include_stop_str_in_output, skip_special_tokens, prompt_logprobs,
truncate_prompt_tokens, return_token_ids, request_id, priority (0 only: this server
schedules first come, first served), and for chat add_generation_prompt,
continue_final_message, add_special_tokens, chat_template, documents, reasoning_effort and
include_reasoning. Structured outputs come as OpenAI's `response_format` (`json_object`,
`json_schema`, and vLLM's `structural_tag`), vLLM's `structured_outputs` (json, regex,
choice, grammar, json_object, structural_tag) or its older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` (Lark or GBNF), one per request. A regex is
llguidance's (Rust's syntax): `\\d` and `\\w` match any Unicode digit or letter, as in
Python's `re` — write `[0-9]` for ASCII digits. Every number
in a body is bounded here, by the schema, from one table (`sampling_params.BOUNDS`, which
`SamplingParams` checks too): a value outside is a 400 naming the field, the value and
the range, before anything reaches the engine's tensors.

Chat requests take OpenAI's `tools` and `tool_choice`: tools are rendered by the chat
template, calls read out of the output by the server's `--tool-call-parser`
(`lathe.serve.tool_calls`), and "required" or a named function forces a call by grammar.

Nothing is dropped silently: a field this server does not implement (`functions`,
`suffix`, `best_of` other than n, any unknown name)
is a `ProtocolError` naming it, as vLLM answers. Text anywhere in a body must be valid
Unicode: a lone surrogate (`"\\ud800"` in JSON) is refused before it can reach the
tokenizer.

With `return_token_ids`, a completions choice also carries lathe's `weight_version`: how
many weight updates (`POST /update_weights`) preceded the weights that drew it, so a
trainer's rollouts know which policy sampled them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    model_validator,
)
from pydantic_core import PydanticCustomError
from tokenizers import Tokenizer

from lathe.data.chat_template import TEMPLATE_ARGUMENTS
from lathe.data.messages import Message, MessageError, normalize_message, normalize_tools
from lathe.serve.outputs import CompletionOutput, TokenLogprob
from lathe.serve.replies import (
    ReplyFormat,
    ReplyStream,
    reasoning_tokens,
    whole_reply,
)
from lathe.serve.sampling_defaults import SamplingDefaults, with_defaults
from lathe.serve.sampling_params import (
    BOUNDS,
    INT32_MAX,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    Bound,
    SamplingParams,
)
from lathe.serve.structured import GrammarError, Literals, StructuredOutput
from lathe.serve.tool_calls import PARSERS, ToolCallParser


class ProtocolError(ValueError):
    """A request field this server refuses (the message names it); answered with a 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _lone_surrogate(body: Any) -> str | None:
    """The path of the first string (or key) holding a lone surrogate, if any."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if any("\ud800" <= ch <= "\udfff" for ch in value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                name = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and any("\ud800" <= ch <= "\udfff" for ch in key):
                    return name
                stack.append((name, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def _within(bound: Bound) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not bound.holds(value):
            raise PydanticCustomError("out_of_bounds", "must be {allowed}",
                                      {"allowed": str(bound)})
        return value
    return check


def bounded(kind: type, name: str) -> Any:
    """`kind` (int or float) within `BOUNDS[name]`; floats must be finite."""
    extra = {"allow_inf_nan": False} if kind is float else {}
    return Annotated[kind, Field(**extra), AfterValidator(_within(BOUNDS[name]))]


TokenId = bounded(int, "token_id")


def _harmless(values: tuple) -> Callable[[Any], bool]:
    return lambda value: value in values


# OpenAI fields this server accepts only with the value that means "not used"; anything
# else is refused with the reason.
_ONLY_UNUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_harmless((None, [])), "function calling is not supported by this server"),
    "function_call": (_harmless((None, "none")),
                      "function calling is not supported by this server"),
    "suffix": (_harmless((None, "")), "insertion (suffix) is not supported by this model"),
    "store": (_harmless((None, False)), "this server does not store completions"),
    "metadata": (lambda _: True, ""),  # annotates stored completions; nothing is stored
    "user": (lambda value: value is None or isinstance(value, str), "must be a string"),
    "service_tier": (_harmless((None, "auto", "default")), "this server has one tier"),
    "modalities": (_harmless((None, ["text"])), "this model reads and writes text only"),
}


MAX_CHOICES = 1024


def _json_value(value: Any, where: str) -> Any:
    """`value`, parsed when it came as JSON text; `ProtocolError` naming `where` if not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError) as error:
        raise ProtocolError(f"{where}: not JSON ({error or 'nested too deeply'})",
                            where.split(".")[0]) from None


def _schema_text(schema: Any, where: str) -> str:
    schema = _json_value(schema, where)
    if not isinstance(schema, dict):
        raise ProtocolError(f"{where} must be a JSON schema object", where.split(".")[0])
    return json.dumps(schema)


def structural_tag(value: Any, where: str, literals: Literals) -> StructuredOutput:
    """vLLM's structural tag (`{"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`, as an object or its JSON text): free text in which each
    trigger starts one of the structures beginning with it, whose body must match its
    schema. Markers are spelled as the tokenizer has them (`literals`)."""
    value = _json_value(value, where)
    param = where.split(".")[0]
    structures = value.get("structures") if isinstance(value, dict) else None
    triggers = value.get("triggers") if isinstance(value, dict) else None
    if not (isinstance(structures, list) and structures and isinstance(triggers, list)
            and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise ProtocolError(f"{where} must be {{\"type\": \"structural_tag\", \"structures\": "
                            "[{\"begin\", \"schema\", \"end\"}, ...], \"triggers\": [...]}",
                            param)
    rules, tags = [], []
    for i, item in enumerate(structures):
        at = f"{where}.structures[{i}]"
        if not (isinstance(item, dict) and isinstance(item.get("begin"), str)
                and isinstance(item.get("end"), str) and isinstance(item.get("schema"), dict)):
            raise ProtocolError(f"{at} must be {{\"begin\": str, \"schema\": {{...}}, "
                                "\"end\": str}", param)
        trigger = next((t for t in triggers if item["begin"].startswith(t)), None)
        if trigger is None:
            raise ProtocolError(f"{at}.begin {item['begin']!r} starts with none of the "
                                "triggers", param)
        body = (f"{literals(item['begin'][len(trigger):])} %json {json.dumps(item['schema'])} "
                f"{literals(item['end'])}")
        if trigger in literals.added:  # a token: the text before it stays free
            rules.append(f"tag_{i}: TEXT {literals(trigger)} {body}")
        else:  # a text trigger: lazily matched where the free text first contains it
            rules += [f"tag_{i}_trigger[lazy]: TEXT {json.dumps(trigger)}",
                      f"tag_{i}: tag_{i}_trigger {body}"]
        tags.append(f"tag_{i}")
    grammar = "\n".join(["%llguidance {}", f"start: ({' | '.join(tags)})* TEXT",
                         "TEXT: /(.|\\n)*/", *rules])
    return StructuredOutput(grammar=grammar)


def _response_format(value: dict[str, Any], literals: Literals) -> StructuredOutput | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json='{"type": "object"}')
    if kind == "structural_tag":
        return structural_tag(value, "response_format", literals)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ProtocolError("response_format.json_schema must be {\"name\", \"schema\", "
                                "\"strict\"?} with the schema under \"schema\"",
                                "response_format")
        try:
            return StructuredOutput(json=_schema_text(spec["schema"],
                                                      "response_format.json_schema.schema"))
        except GrammarError as error:
            raise ProtocolError(f"response_format: {error}", "response_format") from None
    raise ProtocolError(f"response_format.type {kind!r} is not one of text, json_object, "
                        "json_schema, structural_tag", "response_format")


def _guided_json(value: dict[str, Any] | str) -> StructuredOutput:
    return StructuredOutput(json=_schema_text(value, "guided_json"))


def _guided_regex(value: str) -> StructuredOutput:
    return StructuredOutput(regex=value)


def _guided_choice(value: list[str]) -> StructuredOutput:
    return StructuredOutput(choice=tuple(value))


def _guided_grammar(value: str) -> StructuredOutput:
    return StructuredOutput(grammar=value)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (≥ 0.12): one constraint. `disable_any_whitespace` is
    what lathe always does (compact JSON), so only its default is refused."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None

    def spec(self, literals: Literals) -> StructuredOutput:
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, "json_" if name == "json" else name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ProtocolError(f"structured_outputs takes exactly one of json, regex, choice, "
                                f"grammar, json_object, structural_tag; got "
                                f"{', '.join(given) or 'none'}", "structured_outputs")
        if self.disable_any_whitespace is False:
            raise ProtocolError("structured_outputs.disable_any_whitespace=false: this server "
                                "always writes compact JSON; leave it out",
                                "structured_outputs")
        kind = given[0]
        where = f"structured_outputs.{kind}"
        try:
            if kind == "json":
                return StructuredOutput(json=_schema_text(self.json_, where))
            if kind == "json_object":
                return StructuredOutput(json='{"type": "object"}')
            if kind == "structural_tag":
                return structural_tag(self.structural_tag, where, literals)
            if kind == "choice":
                return StructuredOutput(choice=tuple(self.choice or ()))
            return StructuredOutput(**{kind: getattr(self, kind)})
        except GrammarError as error:
            raise ProtocolError(f"{where}: {error}", "structured_outputs") from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class RequestBody(BaseModel):
    """A request body whose text is valid Unicode (a lone surrogate cannot be encoded)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        where = _lone_surrogate(body)
        if where is not None:
            raise PydanticCustomError(
                "lone_surrogate", "{where}: text holds a lone UTF-16 surrogate; send valid "
                "Unicode", {"where": where.encode("ascii", "backslashreplace").decode()})
        return body


class _Request(RequestBody):
    model_config = ConfigDict(extra="allow")

    model: str
    temperature: bounded(float, "temperature") | None = None
    top_p: bounded(float, "top_p") | None = None
    n: bounded(int, "n") | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: bounded(int, "seed") | None = None
    presence_penalty: bounded(float, "presence_penalty") | None = None
    frequency_penalty: bounded(float, "frequency_penalty") | None = None
    logit_bias: Annotated[dict[TokenId, bounded(float, "logit_bias")],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    top_k: bounded(int, "top_k") | None = None
    min_p: bounded(float, "min_p") | None = None
    repetition_penalty: bounded(float, "repetition_penalty") | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    min_tokens: bounded(int, "min_tokens") | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(
        min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # only slow (Python) tokenizers put spaces there; a tokenizer.json never does (vLLM too)
    spaces_between_special_tokens: bool = True
    prompt_logprobs: bounded(int, "prompt_logprobs") | None = None
    # keep the prompt's last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    return_token_ids: bool = False
    priority: Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)] = 0
    request_id: Annotated[str, Field(min_length=1, max_length=128,
                                     pattern=r"^[A-Za-z0-9._:-]+$")] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream) and self.stream_options is not None and \
            self.stream_options.include_usage

    def check_supported(self) -> None:
        """Raise `ProtocolError` for the first field this server would otherwise ignore."""
        for name, value in (self.model_extra or {}).items():
            accepted, reason = _ONLY_UNUSED.get(name, (None, ""))
            shown = name.encode("ascii", "backslashreplace").decode()
            if accepted is None:
                raise ProtocolError(f"unknown parameter `{shown}`: this server does not "
                                    "support it; remove it", shown)
            if not accepted(value):
                raise ProtocolError(f"{name}: {reason}", name)
        if self.priority != 0:
            raise ProtocolError(f"priority={self.priority}: priority scheduling is not "
                                "enabled on this server (it serves first come, first "
                                "served); send 0 or leave it out", "priority")

    def structured_output(self, literals: Literals) -> tuple[str, StructuredOutput] | None:
        """The request's constraint and the field that gave it (markers spelled by
        `literals`); `ProtocolError` naming the field when it is malformed or a second one
        is given."""
        given = []
        if self.response_format is not None:
            spec = _response_format(self.response_format, literals)
            if spec is not None:
                given.append(("response_format", spec))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs.spec(literals)))
        for name, make in (("guided_json", _guided_json), ("guided_regex", _guided_regex),
                           ("guided_choice", _guided_choice),
                           ("guided_grammar", _guided_grammar)):
            value = getattr(self, name)
            if value is not None:
                try:
                    given.append((name, make(value)))
                except GrammarError as error:
                    raise ProtocolError(f"{name}: {error}", name) from None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise ProtocolError(f"{names}: give one structured output per request",
                                given[1][0])
        return given[0] if given else None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutput | None = None,
                        bad_words_ids: list[list[int]] | None = None,
                        skip_special_tokens: bool | None = None,
                        score_only: bool = False,
                        defaults: SamplingDefaults | None = None) -> SamplingParams:
        """The engine's parameters (raises `SamplingError` naming a field out of range).
        `bad_words_ids`: the request's bad words as the tokenizer spells them;
        `skip_special_tokens`: the request's, unless a tool or reasoning parser needs the
        markers it reads kept; `score_only`: echo with max_tokens=0; `defaults`: the
        checkpoint's sampling, for what the request leaves unset, and its output limit."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = with_defaults({
            "max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "n": self.n,
            "stop_token_ids": self.stop_token_ids, "logit_bias": self.logit_bias,
            "min_tokens": self.min_tokens, "allowed_token_ids": self.allowed_token_ids},
            defaults or {})
        return SamplingParams(
            seed=self.seed, stop=stop, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, structured=structured,
            bad_words_ids=bad_words_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens if skip_special_tokens is None
            else skip_special_tokens, score_only=score_only,
            **{name: value for name, value in given.items() if value is not None})


class CompletionRequest(_Request):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=0, le=BOUNDS["max_tokens"].high)] | None = 16
    logprobs: bounded(int, "logprobs") | None = None
    echo: bool = False
    best_of: bounded(int, "n") | None = None
    add_special_tokens: bool = True  # a text prompt gets the tokenizer's BOS and the like

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ProtocolError(f"best_of={self.best_of} is not supported: only best_of = n "
                                f"(= {self.n or 1}); sample n completions and rank them "
                                "yourself", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise ProtocolError("max_tokens=0 generates nothing; it needs echo=true (to "
                                "score the prompt) or give max_tokens >= 1", "max_tokens")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[Any] | None = None


def message_text(index: int, message: ChatMessage) -> Message:
    """One message as the chat template takes it (`lathe.data.messages`: tool calls with
    their arguments as objects, tool results, reasoning); `developer` is the system role
    under its newer name. Raises `ProtocolError` naming what is wrong."""
    raw = {"role": "system" if message.role == "developer" else message.role,
           "content": message.content, **(message.model_extra or {})}
    try:
        return normalize_message(raw, f"messages[{index}]")
    except MessageError as error:
        raise ProtocolError(str(error), "messages") from None


@dataclass
class ToolPlan:
    """What a chat request's tools ask of the server: the tools the template renders, the
    parser that reads calls out of the output (None: `tool_choice` "none"), and the
    grammar that forces a call ("required" or a named function)."""

    tools: list[dict[str, Any]]
    parser: ToolCallParser | None
    structured: StructuredOutput | None
    named: bool = False  # tool_choice named the function (OpenAI then finishes with "stop")
    parallel: bool = True  # parallel_tool_calls false: a reply's first call alone


class ChatRendering(RequestBody):
    """What a chat is rendered from: its messages and tools, and the template's switches."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    # extra chat template variables (vLLM's), e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes BOS and the like itself
    chat_template: Annotated[str, Field(max_length=1 << 16)] | None = None
    documents: Annotated[list[dict[str, Any]], Field(max_length=1024)] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    def check_rendering(self) -> None:
        """Raise `ProtocolError` for template switches that cannot go together."""
        for key in self.chat_template_kwargs or {}:
            if key in TEMPLATE_ARGUMENTS:
                raise ProtocolError(f"chat_template_kwargs.{key}: the server sets {key!r} "
                                    "itself; remove it", "chat_template_kwargs")
        if self.continue_final_message and self.add_generation_prompt:
            raise ProtocolError("continue_final_message and add_generation_prompt cannot both "
                                "be true: set add_generation_prompt=false to continue the last "
                                "message", "continue_final_message")

    def template_kwargs(self) -> dict[str, Any]:
        """The template's variables beyond messages and tools: chat_template_kwargs, then
        reasoning_effort (read by templates such as gpt-oss's)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    def chat(self) -> list[Message]:
        return [message_text(i, message) for i, message in enumerate(self.messages)]


class ChatCompletionRequest(_Request, ChatRendering):
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: bounded(int, "max_tokens") | None = None
    max_completion_tokens: bounded(int, "max_tokens") | None = None
    logprobs: bool | None = False
    top_logprobs: bounded(int, "logprobs") | None = None
    include_reasoning: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs needs logprobs=true", "top_logprobs")
        self.check_rendering()

    def tool_plan(self, parser: ToolCallParser | None, literals: Literals,
                  max_tool_calls: int) -> ToolPlan | None:
        """The request's tools and `tool_choice` (default "auto" with tools, as OpenAI's),
        checked; None without tools. `parser`: the server's `--tool-call-parser`;
        `literals`: how its grammar spells markers; `max_tool_calls`: how many calls a
        forced reply may make (one without parallel calls)."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise ProtocolError(f"tool_choice={choice!r} needs tools", "tool_choice")
            return None
        try:
            tools = normalize_tools(self.tools, "tools")
        except MessageError as error:
            raise ProtocolError(str(error), "tools") from None
        names = [t["function"]["name"] for t in tools]
        choice = "auto" if choice is None else choice
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise ProtocolError("tool_choice must be none, auto, required or {\"type\": "
                                    "\"function\", \"function\": {\"name\": ...}}",
                                    "tool_choice")
            if name not in names:
                raise ProtocolError(f"tool_choice names {name!r}, which is not among the "
                                    f"tools ({', '.join(names)})", "tool_choice")
        elif choice not in ("none", "auto", "required"):
            raise ProtocolError(f"tool_choice={choice!r} is not one of none, auto, required "
                                "or a named function", "tool_choice")
        if choice == "none":
            return ToolPlan(tools, None, None)
        if parser is None:
            raise ProtocolError("tool calling needs to know the format this model writes "
                                "calls in, which its chat template does not show: start the "
                                f"server with --tool-call-parser ({', '.join(PARSERS)}); or "
                                "send tool_choice=\"none\"", "tools")
        parser = parser.for_tools(tools)
        parallel = self.parallel_tool_calls is not False
        if choice == "auto":
            return ToolPlan(tools, parser, None, parallel=parallel)
        forced = tools if choice == "required" else [t for t in tools
                                                     if t["function"]["name"] == name]
        several = choice == "required" and parallel
        try:
            grammar = parser.grammar(forced, max_tool_calls if several else 1, literals)
        except GrammarError as error:
            raise ProtocolError(f"tools: the grammar that forces a call to them cannot be "
                                f"built: {error}; send fewer or smaller tools", "tools") from None
        return ToolPlan(tools, parser, grammar, named=choice != "required", parallel=parallel)

    @property
    def completion_budget(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) or max_tokens; None: the rest of
        the context window."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# `POST /tokenize` and `/detokenize`, as vLLM's: a prompt, or a chat rendered through the
# served template, as the token ids the model would be given, and back
class TokenizeCompletionRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatRendering):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    return_token_strs: bool = False


def _tokenize_kind(body: Any) -> str:
    return "[chat]" if isinstance(body, dict) and "messages" in body else "[prompt]"


# a body with messages is a chat, else a prompt: an error then is the one member's (the
# server leaves bracketed tags out of the field's path)
TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("[chat]")]
    | Annotated[TokenizeCompletionRequest, Tag("[prompt]")],
    Discriminator(_tokenize_kind)]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


class UpdateWeightsRequest(BaseModel):
    """The body of /update_weights: a folder of the served model's safetensors shards (a
    checkpoint's, or what `lathe.model.checkpoint.write_weights` pushes from a trainer)."""

    model_config = ConfigDict(extra="forbid")

    path: Annotated[str, Field(min_length=1, max_length=4096)]


class LoraAdapterRequest(BaseModel):
    """vLLM's body of /v1/load_lora_adapter and /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid")

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: the prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else str(token_id)


@dataclass
class Echo:
    """A completions prompt sent back in front of its completion (`echo`): its text and,
    when log-probabilities were asked for, one entry per prompt token (None first)."""

    text: str | None  # None: decode token_ids (once they are validated)
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None = None


def completion_logprobs(tokenizer: Tokenizer | None, logprobs: list[TokenLogprob],
                        offset: int = 0, echo: Echo | None = None) -> dict[str, list]:
    """The legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs,
    text_offset). As in vLLM, each top_logprobs map also holds the chosen token, so
    logprobs=0 still names it; echoed prompt tokens come first, the first one null."""
    entries: list[TokenLogprob | None] = list(logprobs)
    token_ids = [lp.token_id for lp in logprobs]
    if echo is not None:
        prompt = echo.logprobs or [None] * len(echo.token_ids)
        entries, token_ids = prompt + entries, echo.token_ids + token_ids
    tokens = [_token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)

    def top(entry: TokenLogprob | None) -> dict[str, float] | None:
        if entry is None:
            return None
        best = {_token_text(tokenizer, t): v for t, v in entry.top}
        best.setdefault(_token_text(tokenizer, entry.token_id), entry.logprob)
        return best

    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [top(e) for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer | None, logprobs: list[TokenLogprob]) -> dict[str, list]:
    """The chat `logprobs.content` list."""
    def entry(token_id: int, value: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}
    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs]}


def prompt_logprobs_json(tokenizer: Tokenizer | None,
                         entries: list[TokenLogprob | None]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) its own and its top
    tokens' {logprob, rank, decoded_token}, keyed by token id."""
    def entry(lp: TokenLogprob) -> dict[str, Any]:
        ranked = {lp.token_id: (lp.logprob, lp.rank)}
        for rank, (token, value) in enumerate(lp.top, start=1):
            ranked.setdefault(token, (value, rank))
        return {str(token): {"logprob": value, "rank": rank,
                             "decoded_token": _token_text(tokenizer, token)}
                for token, (value, rank) in ranked.items()}
    return [None if lp is None else entry(lp) for lp in entries]


@dataclass
class ResponseOptions:
    """What a request asked of its response bodies beyond the choices' text. `prompts`:
    each prompt's token ids (n choices each); `reply`: how chat choices are read
    (reasoning, tool calls); `request_id`: the client's, put in the response id."""

    prompts: list[list[int]]
    n: int = 1
    return_token_ids: bool = False
    want_prompt_logprobs: bool = False
    reply: ReplyFormat = ReplyFormat()
    include_reasoning: bool = True
    request_id: str | None = None


class ResponseBuilder:
    """Response and chunk bodies of one request (shared id, creation time and model)."""

    def __init__(self, kind: Literal["completion", "chat"], model: str,
                 tokenizer: Tokenizer | None, options: ResponseOptions) -> None:
        self.kind, self.model, self.tokenizer, self.options = kind, model, tokenizer, options
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        self.id = f"{prefix}-{options.request_id}" if options.request_id else new_id(prefix)
        self.created = int(time.time())
        self.prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}  # by prompt index
        self._streams: dict[int, ReplyStream] = {}
        self._token_ids: dict[int, list[int]] = {}  # streamed choices' tokens (usage)

    def _envelope(self, obj: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _prompt_extras(self, prompt_index: int) -> dict[str, Any]:
        """A completions choice's prompt_token_ids and prompt_logprobs, where asked for."""
        extras: dict[str, Any] = {}
        if self.options.return_token_ids:
            extras["prompt_token_ids"] = self.options.prompts[prompt_index]
        if self.options.want_prompt_logprobs and prompt_index in self.prompt_logprobs:
            extras["prompt_logprobs"] = prompt_logprobs_json(
                self.tokenizer, self.prompt_logprobs[prompt_index])
        return extras

    def _usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               reasoning: int | None) -> dict[str, Any]:
        counted = usage(prompt_tokens, completion_tokens, cached_tokens)
        if reasoning is not None:
            counted["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return counted

    def response(self, outputs: list[CompletionOutput], want_logprobs: bool,
                 prompt_tokens: int, cached_tokens: int,
                 echoes: list[Echo | None] | None = None) -> dict[str, Any]:
        """`echoes[i]`: the prompt to put in front of choice i (completions with echo)."""
        completion_tokens = sum(len(o.token_ids) for o in outputs)
        form = self.options.reply
        choices, reasoned = [], 0
        ids = self.options.return_token_ids
        for i, o in enumerate(outputs):
            if self.kind == "completion":
                echo = echoes[i] if echoes else None
                logprobs = completion_logprobs(self.tokenizer, o.logprobs, echo=echo) \
                    if want_logprobs else None
                text = ((echo.text or "") if echo else "") + o.text
                choices.append({"index": o.index, "text": text, "logprobs": logprobs,
                                "finish_reason": o.finish_reason,
                                **({"token_ids": o.token_ids,
                                    "weight_version": o.weight_version} if ids else {}),
                                **self._prompt_extras(i // self.options.n)})
                continue
            logprobs = chat_logprobs(self.tokenizer, o.logprobs) if want_logprobs else None
            reply = whole_reply(form, o.text, o.finish_reason)
            if form.reasoning is not None:
                reasoned += reasoning_tokens(self.tokenizer, o.token_ids, reply.reasoning,
                                             form.reasoning)
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if form.reasoning is not None and self.options.include_reasoning:
                message["reasoning_content"] = reply.reasoning or None
            if reply.calls:
                message["content"] = reply.content or None
                message["tool_calls"] = [call.to_openai() for call in reply.calls]
            choices.append({"index": o.index, "logprobs": logprobs,
                            "finish_reason": reply.finish_reason, "message": message,
                            **({"token_ids": o.token_ids} if ids else {})})
        if self.kind == "completion":
            return self._envelope("text_completion", choices,
                                  usage=usage(prompt_tokens, completion_tokens, cached_tokens))
        extra: dict[str, Any] = {}
        if ids:
            extra["prompt_token_ids"] = self.options.prompts[0]
        if self.options.want_prompt_logprobs and 0 in self.prompt_logprobs:
            extra["prompt_logprobs"] = prompt_logprobs_json(self.tokenizer,
                                                            self.prompt_logprobs[0])
        return self._envelope("chat.completion", choices, **extra, usage=self._usage(
            prompt_tokens, completion_tokens, cached_tokens,
            reasoned if form.reasoning else None))

    def chunk(self, index: int, text: str, token_ids: list[int],
              logprobs: list[TokenLogprob] | None, finish_reason: str | None,
              first: bool = False, echo: Echo | None = None) -> dict[str, Any]:
        ids = {"token_ids": token_ids} if self.options.return_token_ids else {}
        if self.kind == "completion":
            choice = {"index": index, "text": ((echo.text or "") if echo else "") + text,
                      "finish_reason": finish_reason,
                      "logprobs": None if logprobs is None
                      else completion_logprobs(self.tokenizer, logprobs, echo=echo), **ids,
                      **(self._prompt_extras(index // self.options.n) if first else {})}
            return self._envelope("text_completion", [choice])
        form = self.options.reply
        stream = self._streams.setdefault(index, ReplyStream(form))
        self._token_ids.setdefault(index, []).extend(token_ids)
        reasoning, text, calls = stream.feed(text)
        if finish_reason is not None:
            end = stream.finish(finish_reason)
            reasoning, text = reasoning + (end.reasoning or ""), text + end.content
            calls, finish_reason = calls + end.calls, end.finish_reason
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else \
            ({"content": text} if text else {})
        if reasoning and self.options.include_reasoning:
            delta["reasoning_content"] = reasoning
        if calls:  # each whole, as soon as it is complete; numbered through the reply
            delta["tool_calls"] = [call.to_openai(i) for i, call in enumerate(
                calls, start=stream.called - len(calls))]
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": None if logprobs is None
                  else chat_logprobs(self.tokenizer, logprobs), **ids}
        extra: dict[str, Any] = {}
        if first and self.options.return_token_ids:
            extra["prompt_token_ids"] = self.options.prompts[0]
        if first and self.options.want_prompt_logprobs and 0 in self.prompt_logprobs:
            extra["prompt_logprobs"] = prompt_logprobs_json(self.tokenizer,
                                                            self.prompt_logprobs[0])
        return self._envelope("chat.completion.chunk", [choice], **extra)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int) -> dict[str, Any]:
        if self.kind == "completion":
            return self._envelope("text_completion", [],
                                  usage=usage(prompt_tokens, completion_tokens, cached_tokens))
        reasoned = None
        if self.options.reply.reasoning is not None:
            reasoned = sum(reasoning_tokens(self.tokenizer, self._token_ids.get(i, []),
                                            stream.reasoning, self.options.reply.reasoning)
                           for i, stream in self._streams.items())
        return self._envelope("chat.completion.chunk", [], usage=self._usage(
            prompt_tokens, completion_tokens, cached_tokens, reasoned))
