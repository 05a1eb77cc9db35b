"""lathe's chat format, in one place: the special tokens, the Python formatter that
post-training uses, and the Jinja template written into `tokenizer_config.json` so that
`transformers`' `apply_chat_template` produces exactly the same string.

    <|begin_of_text|><|system|>\nYou are terse.<|end_of_turn|><|user|>\nHi<|end_of_turn|>
    <|assistant|>\nHello.<|end_of_turn|>

(one line in reality). A generation prompt is `<|assistant|>\n`; a model's turn ends
with `<|end_of_turn|>`, which is therefore the chat EOS token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from tokenizers import Tokenizer

from lathe.core.errors import ConfigError

BOS = "<|begin_of_text|>"
END_OF_TURN = "<|end_of_turn|>"
PAD = "<|pad|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = [BOS, END_OF_TURN, PAD] + [f"<|{role}|>" for role in ROLES]


class Message(TypedDict):
    role: str
    content: str


def role_header(role: str) -> str:
    return f"<|{role}|>\n"


def format_chat(messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    parts = [BOS]
    for i, message in enumerate(messages):
        if message.get("role") not in ROLES:
            raise ConfigError(f"messages[{i}].role is {message.get('role')!r}; "
                              f"use one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ConfigError(f"messages[{i}].content must be a string")
        parts.append(role_header(message["role"]) + message["content"] + END_OF_TURN)
    if add_generation_prompt:
        parts.append(role_header("assistant"))
    return "".join(parts)


def assistant_spans(messages: Sequence[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The formatted conversation and the character spans a model is trained to write:
    each assistant message's content and the end-of-turn token after it."""
    text = format_chat(messages)
    spans, cursor = [], len(BOS)
    for message in messages:
        start = cursor + len(role_header(message["role"]))
        cursor = start + len(message["content"]) + len(END_OF_TURN)
        if message["role"] == "assistant":
            spans.append((start, cursor))
    return text, spans


def tokenize_chat(tokenizer: Tokenizer, messages: Sequence[Message]) -> tuple[list[int],
                                                                             list[bool]]:
    """Token ids of the formatted conversation and, per token, whether it belongs to an
    assistant span (by the token's character offsets, so the mask follows the template
    string exactly even where BPE merges across a boundary)."""
    text, spans = assistant_spans(messages)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    mask = [any(start <= a and b <= end for start, end in spans) and b > a
            for a, b in encoding.offsets]
    return encoding.ids, mask


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '" + END_OF_TURN + "' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
