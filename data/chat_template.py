"""A checkpoint's chat template (the Jinja string in tokenizer_config.json), rendered the
way `transformers`' `apply_chat_template` renders it: a sandboxed environment, the
tokenizer's special tokens as variables and `raise_exception` for template errors.

Rendering here runs in the caller's process with no time or size limit, which suits a
template the user chose to train on; a server renders a checkpoint's template through
`lathe.data.template_worker`, which bounds both.
"""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lathe.core.checkpoint_files import checkpoint_file, read_json_object
from lathe.core.errors import CheckpointError

CHECK_MESSAGES = [{"role": "user", "content": "Hi"}]  # what every chat template must render


class ChatTemplateError(ValueError):
    """The messages do not fit the template (unknown role, missing content, ...)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def read_chat_template(path: str | Path) -> tuple[str, dict[str, str]]:
    """A checkpoint's chat template source and the special tokens it sees as variables
    (read, not parsed: parsing is the renderer's work)."""
    path = Path(path)
    config_file = checkpoint_file(path, "tokenizer_config.json")
    config = read_json_object(config_file) if config_file.is_file() else {}
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{config_file}: chat_template must be a string (one Jinja "
                              f"template), not a {type(template).__name__}")
    jinja_file = checkpoint_file(path, "chat_template.jinja")
    if not template and jinja_file.is_file():
        try:
            template = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{jinja_file}: cannot be read ({error})") from None
    if not template:
        raise CheckpointError(f"{path} has no chat template (tokenizer_config.json "
                              "chat_template); train the tokenizer with `lathe tokenizer "
                              "train` or use /v1/completions")
    specials = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        specials[key] = value if isinstance(value, str) else ""
    return template, specials


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str]) -> None:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise
        try:
            self.template = environment.from_string(template)
        except TemplateError as error:
            raise CheckpointError(f"the chat template does not parse: {error}") from None
        except RecursionError:
            raise CheckpointError("the chat template does not parse: nested too deeply") \
                from None
        self.special_tokens = special_tokens

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ChatTemplate:
        return cls(*read_chat_template(path))

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text; `ChatTemplateError` when the template refuses the messages or
        fails on them (a template is code: whatever it raises fails this request only)."""
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except ChatTemplateError:
            raise
        except TemplateError as error:
            raise ChatTemplateError(f"chat template failed: {error}") from None
        except Exception as error:
            raise ChatTemplateError(f"the checkpoint's chat template failed on these "
                                    f"messages: {type(error).__name__}: {error}") from None

    def check(self) -> None:
        """Raise `CheckpointError` unless the template renders one user message (run
        once at load, so a broken template is reported there, not on every request)."""
        try:
            self.render(CHECK_MESSAGES)
        except ChatTemplateError as error:
            raise CheckpointError(f"its chat template cannot render one user message: "
                                  f"{error}") from None
