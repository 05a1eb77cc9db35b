"""OpenAI request bodies (pydantic) and the response and chunk JSON the server sends.

Field names and defaults follow OpenAI's API (completions default to 16 tokens, chat to
the rest of the context window; a null field means its default); vLLM's extras top_k,
min_p, repetition_penalty, stop_token_ids and ignore_eos are accepted too, and structured
outputs as OpenAI's `response_format` (`json_object`, `json_schema`) or vLLM's
`guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` (Lark or GBNF), one
per request. Every number
in a body is bounded here, by the schema, from one table (`sampling.BOUNDS`, which
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
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError
from tokenizers import Tokenizer

from lathe.data.chat_template import TEMPLATE_ARGUMENTS
from lathe.data.messages import Message, MessageError, normalize_message, normalize_tools
from lathe.serve.logprobs import TokenLogprob
from lathe.serve.outputs import CompletionOutput
from lathe.serve.sampling import (
    BOUNDS,
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    Bound,
    SamplingParams,
)
from lathe.serve.structured import GrammarError, StructuredOutput
from lathe.serve.tool_calls import PARSERS, ToolCall, ToolCallParser, ToolStream


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


def _bounded(kind: type, name: str) -> Any:
    """`kind` (int or float) within `BOUNDS[name]`; floats must be finite."""
    extra = {"allow_inf_nan": False} if kind is float else {}
    return Annotated[kind, Field(**extra), AfterValidator(_within(BOUNDS[name]))]


TokenId = _bounded(int, "token_id")


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


def _schema_text(schema: Any, where: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as error:
            raise ProtocolError(f"{where}: not JSON ({error or 'nested too deeply'})",
                                where.split(".")[0]) from None
    if not isinstance(schema, dict):
        raise ProtocolError(f"{where} must be a JSON schema object", where.split(".")[0])
    return json.dumps(schema)


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json='{"type": "object"}')
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
                        "json_schema", "response_format")


def _guided_json(value: dict[str, Any] | str) -> StructuredOutput:
    return StructuredOutput(json=_schema_text(value, "guided_json"))


def _guided_regex(value: str) -> StructuredOutput:
    return StructuredOutput(regex=value)


def _guided_choice(value: list[str]) -> StructuredOutput:
    return StructuredOutput(choice=tuple(value))


def _guided_grammar(value: str) -> StructuredOutput:
    return StructuredOutput(grammar=value)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    temperature: _bounded(float, "temperature") | None = None
    top_p: _bounded(float, "top_p") | None = None
    n: _bounded(int, "n") | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: _bounded(int, "seed") | None = None
    presence_penalty: _bounded(float, "presence_penalty") | None = None
    frequency_penalty: _bounded(float, "frequency_penalty") | None = None
    logit_bias: Annotated[dict[TokenId, _bounded(float, "logit_bias")],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    top_k: _bounded(int, "top_k") | None = None
    min_p: _bounded(float, "min_p") | None = None
    repetition_penalty: _bounded(float, "repetition_penalty") | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body: Any) -> Any:
        where = _lone_surrogate(body)
        if where is not None:
            raise PydanticCustomError(
                "lone_surrogate", "{where}: text holds a lone UTF-16 surrogate; send valid "
                "Unicode", {"where": where.encode("ascii", "backslashreplace").decode()})
        return body

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
        self.structured_output()  # a malformed constraint is refused here, named

    def structured_output(self) -> tuple[str, StructuredOutput] | None:
        """The request's constraint and the field that gave it; `ProtocolError` naming the
        field when it is malformed or a second one is given."""
        given = []
        if self.response_format is not None:
            spec = _response_format(self.response_format)
            if spec is not None:
                given.append(("response_format", spec))
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
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """The engine's parameters (raises `SamplingError` naming a field out of range)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "n": self.n,
            "stop_token_ids": self.stop_token_ids, "logit_bias": self.logit_bias}
        return SamplingParams(
            max_tokens=max_tokens, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured,
            **{name: value for name, value in given.items() if value is not None})


class CompletionRequest(_Request):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=0, le=BOUNDS["max_tokens"].high)] | None = 16
    logprobs: _bounded(int, "logprobs") | None = None
    echo: bool = False
    best_of: _bounded(int, "n") | None = None

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


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: _bounded(int, "max_tokens") | None = None
    max_completion_tokens: _bounded(int, "max_tokens") | None = None
    logprobs: bool | None = False
    top_logprobs: _bounded(int, "logprobs") | None = None
    # extra chat template variables (vLLM's), e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs needs logprobs=true", "top_logprobs")
        for key in self.chat_template_kwargs or {}:
            if key in TEMPLATE_ARGUMENTS:
                raise ProtocolError(f"chat_template_kwargs.{key}: the server sets {key!r} "
                                    "itself; remove it", "chat_template_kwargs")

    def template_kwargs(self) -> dict[str, Any]:
        return dict(self.chat_template_kwargs or {})

    def tool_plan(self, parser: ToolCallParser | None) -> ToolPlan | None:
        """The request's tools and `tool_choice` (default "auto" with tools, as OpenAI's),
        checked; None without tools. `parser`: the server's `--tool-call-parser`."""
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
            raise ProtocolError("tool calling needs the server started with --tool-call-parser "
                                f"({', '.join(PARSERS)}), the format this model writes calls "
                                "in; or send tool_choice=\"none\"", "tools")
        if choice == "auto":
            return ToolPlan(tools, parser, None)
        forced = tools if choice == "required" else [t for t in tools
                                                     if t["function"]["name"] == name]
        several = choice == "required" and self.parallel_tool_calls is not False
        return ToolPlan(tools, parser, parser.grammar(forced, several))

    @property
    def completion_budget(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) or max_tokens; None: the rest of
        the context window."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def chat(self) -> list[Message]:
        return [message_text(i, message) for i, message in enumerate(self.messages)]


class LoraAdapterRequest(BaseModel):
    """vLLM's body of /v1/load_lora_adapter and /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid")

    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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


class ResponseBuilder:
    """Response and chunk bodies of one request (shared id, creation time and model)."""

    def __init__(self, kind: Literal["completion", "chat"], model: str,
                 tokenizer: Tokenizer | None, tool_parser: ToolCallParser | None = None) -> None:
        """`tool_parser`: read tool calls out of chat choices (their text becomes calls)."""
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())
        self.tool_parser = tool_parser
        self._streams: dict[int, ToolStream] = {}

    def _envelope(self, obj: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def response(self, outputs: list[CompletionOutput], want_logprobs: bool,
                 prompt_tokens: int, echoes: list[Echo | None] | None = None) -> dict[str, Any]:
        """`echoes[i]`: the prompt to put in front of choice i (completions with echo)."""
        completion_tokens = sum(len(o.token_ids) for o in outputs)
        choices = []
        for i, o in enumerate(outputs):
            if self.kind == "completion":
                echo = echoes[i] if echoes else None
                logprobs = completion_logprobs(self.tokenizer, o.logprobs, echo=echo) \
                    if want_logprobs else None
                text = ((echo.text or "") if echo else "") + o.text
                choices.append({"index": o.index, "text": text, "logprobs": logprobs,
                                "finish_reason": o.finish_reason})
            else:
                logprobs = chat_logprobs(self.tokenizer, o.logprobs) if want_logprobs else None
                message: dict[str, Any] = {"role": "assistant", "content": o.text}
                finish_reason = o.finish_reason
                content, calls = self.tool_parser.split(o.text) if self.tool_parser else (
                    o.text, [])
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [call.to_openai() for call in calls]}
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                choices.append({"index": o.index, "logprobs": logprobs,
                                "finish_reason": finish_reason, "message": message})
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return self._envelope(obj, choices, usage=usage(prompt_tokens, completion_tokens))

    def chunk(self, index: int, text: str, logprobs: list[TokenLogprob] | None,
              finish_reason: str | None, first: bool = False,
              echo: Echo | None = None) -> dict[str, Any]:
        if self.kind == "completion":
            choice = {"index": index, "text": ((echo.text or "") if echo else "") + text,
                      "finish_reason": finish_reason,
                      "logprobs": None if logprobs is None
                      else completion_logprobs(self.tokenizer, logprobs, echo=echo)}
            return self._envelope("text_completion", [choice])
        calls: list[ToolCall] = []
        if self.tool_parser is not None:  # a call's text is held back and sent as the call
            stream = self._streams.setdefault(index, ToolStream(self.tool_parser))
            text = stream.feed(text)
            if finish_reason is not None:
                rest, calls = stream.finish()
                text += rest
                finish_reason = "tool_calls" if calls and finish_reason == "stop" \
                    else finish_reason
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else \
            ({"content": text} if text else {})
        if calls:
            delta["tool_calls"] = [call.to_openai(i) for i, call in enumerate(calls)]
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": None if logprobs is None
                  else chat_logprobs(self.tokenizer, logprobs)}
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return self._envelope(obj, [], usage=usage(prompt_tokens, completion_tokens))
