"""Post-training datasets in the shapes TRL users know, validated record by record.

- chat: `{"messages": [...], "tools"?: [...]}` in OpenAI's chat format (system prompts,
  several turns, assistant `tool_calls`, `tool` results, reasoning; see
  `lathe.data.messages`) with at least one assistant turn;
- preference: `{"prompt", "chosen", "rejected", "tools"?}`, the prompt a string or message
  list, each reply a string or the message list that follows the prompt;
- unpaired (KTO): `{"prompt", "completion", "label", "tools"?}`, `label` true for a
  desirable completion (thumbs up) and false otherwise; preference pairs read as unpaired
  rows give two, the chosen reply desirable and the rejected one not (TRL's
  `unpair_preference_dataset`);
- prompt: `{"prompt", "reference", "tools"?}` — a question and what a verifier compares
  against.

A source is a `.jsonl` file, `hf:NAME[:SPLIT]` (a Hugging Face dataset, via `datasets`),
or `task:NAME` (an embedded task from `lathe.data.tasks`, in the split asked for). A
malformed record raises one `ConfigError` naming the file, the line (or row) and the field.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lathe.core.errors import ConfigError
from lathe.data.messages import (
    Message,
    MessageError,
    normalize_message,
    normalize_messages,
    normalize_tools,
)
from lathe.data.tasks import task_examples
from lathe.data.tools import load_tool

Tools = list[dict[str, Any]] | None


@dataclass(frozen=True)
class Chat:
    messages: list[Message]
    tools: Tools = None
    where: str = ""  # the file and line it came from, for errors about it


@dataclass(frozen=True)
class PreferenceRow:
    prompt: list[Message]
    chosen: list[Message]  # the messages that follow the prompt (one assistant reply, most often)
    rejected: list[Message]
    tools: Tools = None
    where: str = ""
    margin: float = 0.0  # how much better chosen is (a reward model's margin; TRL's "margin")


@dataclass(frozen=True)
class UnpairedRow:
    prompt: list[Message]
    completion: list[Message]  # the messages that follow the prompt
    label: bool  # desirable (thumbs up) or not
    tools: Tools = None
    where: str = ""


@dataclass(frozen=True)
class PromptRow:
    prompt: list[Message]
    reference: str
    tools: Tools = None


def _rows(source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) pairs: "FILE line N" for a .jsonl, "hf:NAME row N" for a dataset."""
    if source.startswith("hf:"):
        from datasets import load_dataset
        name, _, split = source[3:].partition(":")
        for i, row in enumerate(load_dataset(name, split=split or "train")):
            yield f"{source} row {i}", row
        return
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"dataset {source!r}: no such file; give a .jsonl file, "
                          "hf:NAME[:SPLIT] or task:NAME")
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{source} line {number}"
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as error:
                raise ConfigError(f"{where}: not JSON ({error or 'nested too deeply'})") \
                    from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: a record must be a JSON object, not "
                                  f"{type(row).__name__}")
            yield where, row


def _checked(where: str, read: Any, *args: Any) -> Any:
    """`read(*args)`, its `MessageError` re-raised as a `ConfigError` naming the record."""
    try:
        return read(*args)
    except MessageError as error:
        raise ConfigError(f"{where}: {error}") from None


def _reply(value: Any, where: str) -> list[Message]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise MessageError(f"{where} must be a string or a non-empty list of messages")
    messages = [normalize_message(m, f"{where}[{i}]") for i, m in enumerate(value)]
    if messages[0]["role"] != "assistant":
        raise MessageError(f"{where}[0].role is {messages[0]['role']!r}; a reply starts with "
                           "the assistant's message")
    return messages


@functools.cache
def _tool_definitions(names: tuple[str, ...]) -> Tools:
    return [load_tool(name).definition for name in names] or None


def _task(source: str, split: str) -> str | None:
    return source[5:] if source.startswith("task:") else None


def load_chat_dataset(source: str, split: str = "train", limit: int | None = None) -> list[Chat]:
    if (task := _task(source, split)) is not None:
        return [Chat([{"role": "user", "content": r.prompt},
                      *(r.reply or [{"role": "assistant", "content": r.answer}])],
                     _tool_definitions(r.tools), where=f"{source} #{i}")
                for i, r in enumerate(task_examples(task, split, limit))]
    out = []
    for where, row in _rows(source):
        if isinstance(row.get("messages"), str):
            raise ConfigError(f"{where}: messages must be a list of messages, not a string")
        messages = _checked(where, normalize_messages, row.get("messages"), "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise ConfigError(f"{where}: messages has no assistant turn to train on")
        out.append(Chat(messages, _checked(where, normalize_tools, row.get("tools"), "tools"),
                        where))
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
        return [PreferenceRow([{"role": "user", "content": p.prompt}],
                              [{"role": "assistant", "content": p.chosen}],
                              [{"role": "assistant", "content": p.rejected}],
                              where=f"{source} #{i}")
                for i, p in enumerate(builders[task](split, limit))]
    out = []
    for where, row in _rows(source):
        for key in ("prompt", "chosen", "rejected"):
            if key not in row:
                raise ConfigError(f"{where}: missing field {key!r}")
        margin = row.get("margin", 0.0)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) \
                or not math.isfinite(margin):
            raise ConfigError(f"{where}: margin={margin!r} must be a finite number")
        out.append(PreferenceRow(_checked(where, normalize_messages, row["prompt"], "prompt"),
                                 _checked(where, _reply, row["chosen"], "chosen"),
                                 _checked(where, _reply, row["rejected"], "rejected"),
                                 _checked(where, normalize_tools, row.get("tools"), "tools"),
                                 where, float(margin)))
        if limit is not None and len(out) == limit:
            break
    return out


def load_unpaired_dataset(source: str, split: str = "train",
                          limit: int | None = None) -> list[UnpairedRow]:
    """Labelled completions (KTO's data); a source of preference pairs gives each pair's
    chosen reply as desirable and its rejected one as not. `limit` counts rows out."""
    def unpaired(pair: PreferenceRow) -> list[UnpairedRow]:
        return [UnpairedRow(pair.prompt, pair.chosen, True, pair.tools, pair.where),
                UnpairedRow(pair.prompt, pair.rejected, False, pair.tools, pair.where)]

    if _task(source, split) is not None:
        rows = [row for pair in load_preference_dataset(source, split) for row in unpaired(pair)]
        return rows[:limit]
    out: list[UnpairedRow] = []
    for where, row in _rows(source):
        if "label" not in row and {"chosen", "rejected"} <= row.keys():
            out += unpaired(PreferenceRow(
                _checked(where, normalize_messages, row.get("prompt"), "prompt"),
                _checked(where, _reply, row["chosen"], "chosen"),
                _checked(where, _reply, row["rejected"], "rejected"),
                _checked(where, normalize_tools, row.get("tools"), "tools"), where))
        else:
            for key in ("prompt", "completion", "label"):
                if key not in row:
                    raise ConfigError(f"{where}: missing field {key!r} (an unpaired row has "
                                      "prompt, completion and label; a pair prompt, chosen "
                                      "and rejected)")
            if not isinstance(row["label"], bool):
                raise ConfigError(f"{where}: field 'label' must be true or false, not "
                                  f"{row['label']!r}")
            out.append(UnpairedRow(
                _checked(where, normalize_messages, row["prompt"], "prompt"),
                _checked(where, _reply, row["completion"], "completion"), row["label"],
                _checked(where, normalize_tools, row.get("tools"), "tools"), where))
        if limit is not None and len(out) >= limit:
            return out[:limit]
    return out


def load_prompt_dataset(source: str, split: str = "train",
                        limit: int | None = None) -> list[PromptRow]:
    if (task := _task(source, split)) is not None:
        return [PromptRow([{"role": "user", "content": r.prompt}], r.reference,
                          _tool_definitions(r.tools))
                for r in task_examples(task, split, limit)]
    out = []
    for where, row in _rows(source):
        if not isinstance(row.get("reference", row.get("answer")), str):
            raise ConfigError(f"{where}: field 'reference' (or 'answer') must be a string")
        out.append(PromptRow(_checked(where, normalize_messages, row.get("prompt"), "prompt"),
                             row.get("reference", row.get("answer")),
                             _checked(where, normalize_tools, row.get("tools"), "tools")))
        if limit is not None and len(out) == limit:
            break
    return out
