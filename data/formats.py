"""Post-training datasets in the shapes TRL users know, validated row by row.

- chat: `{"messages": [{"role", "content"}, ...]}` (OpenAI form) with at least one
  assistant turn;
- preference: `{"prompt", "chosen", "rejected"}`, each a string or a message list
  (the prompt's messages, the chosen/rejected assistant reply);
- prompt: `{"prompt", "reference"}` — a question and what a verifier compares against.

A source is a `.jsonl` file, `hf:NAME[:SPLIT]` (a Hugging Face dataset, via `datasets`),
or `task:NAME` (an embedded task from `lathe.data.tasks`, in the split asked for). A
malformed row raises one `ConfigError` naming the source, the row and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lathe.core.errors import ConfigError
from lathe.data.chat import ROLES, Message
from lathe.data.tasks import task_examples


@dataclass(frozen=True)
class PreferenceRow:
    prompt: list[Message]
    chosen: str
    rejected: str


@dataclass(frozen=True)
class PromptRow:
    prompt: list[Message]
    reference: str


def _rows(source: str) -> Iterator[dict[str, Any]]:
    if source.startswith("hf:"):
        from datasets import load_dataset
        name, _, split = source[3:].partition(":")
        yield from load_dataset(name, split=split or "train")
        return
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"dataset {source!r}: no such file; give a .jsonl file, "
                          "hf:NAME[:SPLIT] or task:NAME")
    with path.open() as f:
        for number, line in enumerate(f):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(f"{source} row {number}: not JSON ({error})") from None


def _messages(value: Any, where: str, roles: tuple[str, ...] = ROLES) -> list[Message]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} must be a string or a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in roles:
            raise ConfigError(f"{where}[{i}].role must be one of {', '.join(roles)}")
        if not isinstance(message.get("content"), str):
            raise ConfigError(f"{where}[{i}].content must be a string")
        out.append({"role": message["role"], "content": message["content"]})
    return out


def _reply(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    messages = _messages(value, where, roles=("assistant",))
    return messages[-1]["content"]


def _task(source: str, split: str) -> str | None:
    return source[5:] if source.startswith("task:") else None


def load_chat_dataset(source: str, split: str = "train",
                      limit: int | None = None) -> list[list[Message]]:
    if (task := _task(source, split)) is not None:
        return [[{"role": "user", "content": r.prompt}, {"role": "assistant", "content": r.answer}]
                for r in task_examples(task, split, limit)]
    out = []
    for i, row in enumerate(_rows(source)):
        messages = _messages(row.get("messages"), f"{source} row {i}: messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"{source} row {i}: messages has no assistant turn to train on")
        out.append(messages)
        if limit is not None and len(out) == limit:
            break
    return out


def load_preference_dataset(source: str, split: str = "train",
                            limit: int | None = None) -> list[PreferenceRow]:
    if (task := _task(source, split)) is not None:
        from lathe.data.tasks.arithmetic import arithmetic3_preferences, arithmetic_preferences
        from lathe.data.tasks.stdlib_qa import stdlib_qa_preferences
        builders = {"arithmetic": arithmetic_preferences, "arithmetic3": arithmetic3_preferences,
                    "stdlib_qa": stdlib_qa_preferences}
        if task not in builders:
            raise ConfigError(f"no preference pairs for task {task!r}; choose "
                              f"{', '.join(builders)}")
        return [PreferenceRow([{"role": "user", "content": p.prompt}], p.chosen, p.rejected)
                for p in builders[task](split, limit)]
    out = []
    for i, row in enumerate(_rows(source)):
        where = f"{source} row {i}"
        for key in ("prompt", "chosen", "rejected"):
            if key not in row:
                raise ConfigError(f"{where}: missing field {key!r}")
        out.append(PreferenceRow(_messages(row["prompt"], f"{where}: prompt"),
                                 _reply(row["chosen"], f"{where}: chosen"),
                                 _reply(row["rejected"], f"{where}: rejected")))
        if limit is not None and len(out) == limit:
            break
    return out


def load_prompt_dataset(source: str, split: str = "train",
                        limit: int | None = None) -> list[PromptRow]:
    if (task := _task(source, split)) is not None:
        return [PromptRow([{"role": "user", "content": r.prompt}], r.reference)
                for r in task_examples(task, split, limit)]
    out = []
    for i, row in enumerate(_rows(source)):
        where = f"{source} row {i}"
        if not isinstance(row.get("reference", row.get("answer")), str):
            raise ConfigError(f"{where}: field 'reference' (or 'answer') must be a string")
        out.append(PromptRow(_messages(row.get("prompt"), f"{where}: prompt"),
                             row.get("reference", row.get("answer"))))
        if limit is not None and len(out) == limit:
            break
    return out
