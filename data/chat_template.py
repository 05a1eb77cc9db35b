"""A checkpoint's chat template (the Jinja string in tokenizer_config.json, or
chat_template.jinja beside it), rendered the way `transformers`' `apply_chat_template`
renders it, so that what lathe trains on, evaluates and serves is what transformers,
TRL and vLLM would build from the same checkpoint:

- a sandboxed environment with `trim_blocks`/`lstrip_blocks`, `loopcontrols`, a `tojson`
  that keeps non-ASCII text, `raise_exception`, `strftime_now`, and `namespace`/`dict`
  that cannot reach Python internals;
- the tokenizer's named special tokens (`bos_token`, `eos_token`, ...) as variables, then
  `messages`, `tools`, `documents`, `add_generation_prompt` and any extra keyword
  (`enable_thinking`, ...);
- messages with their None-valued keys dropped and their reasoning under every name
  templates read (`reasoning_content`, `thinking`);
- `{% generation %}...{% endgeneration %}` blocks, whose character spans are where a
  model writes (`render_with_spans`).

Rendering here runs in the caller's process with no time or size limit, which suits a
template the user chose to train on; a server renders a checkpoint's template through
`lathe.data.template_worker`, which bounds both.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lathe.core.checkpoint_files import (
    checkpoint_file,
    read_json_object,
    read_processor_template,
)
from lathe.core.errors import CheckpointError, ConfigError

CHECK_MESSAGES = [{"role": "user", "content": "Hi"}]  # what every chat template must render
# a template written for tool use may need tools to render at all (Hermes-3's tool_use)
CHECK_TOOLS = [{"type": "function", "function": {
    "name": "get_time", "description": "The time now.",
    "parameters": {"type": "object", "properties": {}}}}]
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is standard
# what a template is always given by its caller; extra template variables may not replace them
TEMPLATE_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt",
                      "continue_final_message")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

Spans = list[tuple[int, int]]


class ChatTemplateError(ValueError):
    """The messages do not fit the template (unknown role, missing content, ...)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _plain_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return dict(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing attribute names that start with an underscore (the
    way out of the sandbox that CPython's dunder attributes would open)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set {name!r} on a namespace (no leading underscore)")


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged and, while a
    render is being tracked, records the body's character span in the output. The span
    starts where the output streamed so far ends, which is why tracked renders stream."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.tracking: ContextVar[tuple[list[str], Spans] | None] = ContextVar(
            "generation_spans", default=None)

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

    def _track(self, caller: Any) -> str:
        text = caller()
        if (tracking := self.tracking.get()) is not None:
            streamed, spans = tracking
            start = sum(map(len, streamed))
            spans.append((start, start + len(text)))
        return text

    @contextmanager
    def track(self, streamed: list[str], spans: Spans) -> Iterator[None]:
        token = self.tracking.set((streamed, spans))
        try:
            yield
        finally:
            self.tracking.reset(token)


def prepare_messages(messages: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates expect them (transformers' normalization): keys whose value is
    None dropped (OpenAI's `content: null` beside tool calls), and reasoning under
    `reasoning_content` and `thinking` whichever name it came under."""
    prepared = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def read_chat_template(path: str | Path,
                       override: str | Path | None = None) -> tuple[str, dict[str, str]]:
    """A checkpoint's chat template source (or the Jinja file `override`, which replaces
    it) and the special tokens it sees as variables (read, not parsed: parsing is the
    renderer's work)."""
    path = Path(path)
    config_file = checkpoint_file(path, "tokenizer_config.json")
    config = read_json_object(config_file) if config_file.is_file() else {}
    specials = {}
    for key in SPECIAL_TOKEN_NAMES:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            specials[key] = value
    template = read_template_file(override) if override is not None else \
        checkpoint_chat_template(path, config)
    if template is None:
        raise CheckpointError(f"{path} has no chat template (tokenizer_config.json "
                              "chat_template or chat_template.jinja); give one with "
                              "--chat_template FILE, or use /v1/completions")
    return template, specials


# transformers' named templates: {"name": ..., "template": ...} objects, "default" among them
NamedTemplates = list[dict[str, str]]


def checkpoint_chat_templates(path: str | Path, tokenizer_config: dict[str, Any] | None = None,
                              ) -> str | NamedTemplates | None:
    """The template a checkpoint carries, as it holds it: tokenizer_config.json's
    `chat_template` (one template, or transformers' named ones, as Hermes 3 and Command R
    ship them), else chat_template.jinja, else chat_template.json's (a multimodal
    processor's, as Gemma 3's checkpoints from 4B up carry it); None when it carries none."""
    path = Path(path)
    config_file = checkpoint_file(path, "tokenizer_config.json")
    if tokenizer_config is None:
        tokenizer_config = read_json_object(config_file) if config_file.is_file() else {}
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        return _checked_names(config_file, template)
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{config_file}: chat_template must be a string (one Jinja "
                              "template) or a list of {\"name\", \"template\"} objects, not a "
                              f"{type(template).__name__}")
    jinja_file = checkpoint_file(path, "chat_template.jinja")
    if not template and jinja_file.is_file():
        try:
            template = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{jinja_file}: cannot be read ({error})") from None
    return template or read_processor_template(path)


def checkpoint_chat_template(path: str | Path,
                             tokenizer_config: dict[str, Any] | None = None) -> str | None:
    """The checkpoint's template (`checkpoint_chat_templates`) as the one template lathe
    renders: named ones as `apply_chat_template` picks them — `tool_use` where a chat has
    tools, else `default`."""
    templates = checkpoint_chat_templates(path, tokenizer_config)
    if not isinstance(templates, list):
        return templates
    named = {entry["name"]: entry["template"] for entry in templates}
    if "tool_use" not in named:
        return named["default"]
    # `{{ '' }}` beside each tag keeps the environment's trim_blocks and lstrip_blocks off
    # the templates' own first and last characters
    return ("{% if tools is not none %}{{ '' }}" + named["tool_use"] + "{{ '' }}{% else %}"
            "{{ '' }}" + named["default"] + "{{ '' }}{% endif %}")


def _checked_names(config_file: Path, entries: list[Any]) -> NamedTemplates:
    if not all(isinstance(entry, dict) and isinstance(entry.get("name"), str)
               and isinstance(entry.get("template"), str) for entry in entries):
        raise CheckpointError(f"{config_file}: chat_template, a list, must hold "
                              "{\"name\": ..., \"template\": ...} objects of strings")
    names = sorted(entry["name"] for entry in entries)
    if "default" not in names:
        raise CheckpointError(f"{config_file}: chat_template names {names} but no "
                              "\"default\" template, which a chat without tools renders with; "
                              "give one with --chat_template FILE")
    return [{"name": entry["name"], "template": entry["template"]} for entry in entries]


def read_template_file(file: str | Path) -> str:
    """A chat template given as a file (`--chat_template FILE`)."""
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"chat_template={str(file)!r} cannot be read ({error}); give a "
                          "Jinja file") from None
    if not text.strip():
        raise ConfigError(f"chat_template={str(file)!r} is empty; give a Jinja file")
    return text


def continue_final(text: str, messages: list[Mapping[str, Any]]) -> str:
    """`text` (a rendered chat) cut right after the last message's content — or its
    stripped content, for templates that trim (Llama 3's) — as transformers does."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):
        final = "".join(part.get("text", "") for part in final if isinstance(part, dict))
    if not isinstance(final, str) or not final.strip():
        raise ChatTemplateError("continue_final_message needs a last message with text to "
                                "continue")
    for piece in (final, final.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[:at + len(piece)]
    raise ChatTemplateError("continue_final_message: the chat template does not render the "
                            "last message's content, so there is nothing to continue")


class ChatTemplate:
    """One compiled chat template and the special tokens it renders with."""

    def __init__(self, template: str, special_tokens: dict[str, str]) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals.update(raise_exception=_raise, strftime_now=_strftime_now,
                                   dict=_plain_dict, namespace=_Namespace)
        try:
            self.template = environment.from_string(template)
        except TemplateError as error:
            raise CheckpointError(f"the chat template does not parse: {error}") from None
        except RecursionError:
            raise CheckpointError("the chat template does not parse: nested too deeply") \
                from None
        self._generation = environment.extensions[_GenerationBlocks.identifier]
        self.source = template
        self.special_tokens = special_tokens
        self.has_generation_blocks = bool(_GENERATION_TAG.search(template))

    @classmethod
    def from_checkpoint(cls, path: str | Path,
                        override: str | Path | None = None) -> ChatTemplate:
        return cls(*read_chat_template(path, override))

    def render(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None,
               documents: list[dict[str, Any]] | None = None,
               continue_final_message: bool = False, **kwargs: Any) -> str:
        """The chat's text; `ChatTemplateError` when the template refuses the messages or
        fails on them (a template is code: whatever it raises fails this call only).
        `continue_final_message`: the text ends where the last message's content does, so
        the model carries that message on (transformers' `apply_chat_template` rule)."""
        text = self._render(False, messages, add_generation_prompt, tools, documents,
                            kwargs)[0]
        return continue_final(text, messages) if continue_final_message else text

    def render_with_spans(self, messages: list[Mapping[str, Any]],
                          add_generation_prompt: bool = False,
                          tools: list[dict[str, Any]] | None = None,
                          documents: list[dict[str, Any]] | None = None,
                          **kwargs: Any) -> tuple[str, Spans]:
        """The chat's text and the character spans of its `{% generation %}` blocks."""
        return self._render(True, messages, add_generation_prompt, tools, documents, kwargs)

    def _render(self, track: bool, messages: list[Mapping[str, Any]],
                add_generation_prompt: bool, tools: list[dict[str, Any]] | None,
                documents: list[dict[str, Any]] | None,
                kwargs: dict[str, Any]) -> tuple[str, Spans]:
        variables = {**self.special_tokens, **kwargs, "messages": prepare_messages(messages),
                     "tools": tools, "documents": documents,
                     "add_generation_prompt": add_generation_prompt}
        streamed: list[str] = []
        spans: Spans = []
        try:
            if not track:
                return self.template.render(**variables), spans
            with self._generation.track(streamed, spans):
                for piece in self.template.generate(**variables):
                    streamed.append(piece)
            return "".join(streamed), spans
        except ChatTemplateError:
            raise
        except TemplateError as error:
            raise ChatTemplateError(f"chat template failed: {error}") from None
        except Exception as error:
            raise ChatTemplateError(f"the chat template failed on these messages: "
                                    f"{type(error).__name__}: {error}") from None

    def check(self) -> None:
        """Raise `CheckpointError` unless the template renders one user message (run
        once at load, so a broken template is reported there, not on every request)."""
        try:
            self.render(CHECK_MESSAGES)
        except ChatTemplateError as error:
            raise CheckpointError(f"its chat template cannot render one user message: "
                                  f"{error}") from None
