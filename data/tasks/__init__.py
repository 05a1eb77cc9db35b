"""Embedded post-training tasks, generated deterministically so every machine trains and
evaluates on the same rows: multi-digit arithmetic with verifiable answers (also answered
through the calculator tool), questions about standard-library functions answered by their
docstrings' first sentence, and preference pairs (the right answer chosen over a wrong one).
Every task has a `train` and a held-out `test` split, decided by a hash of the question."""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lathe.core.errors import ConfigError

SPLITS = ("train", "test")
HELDOUT_PER_MILLE = 100  # 10 % of questions are held out


@dataclass(frozen=True)
class TaskExample:
    prompt: str  # the user's message
    answer: str  # the assistant's reply (SFT target, chosen side of a preference pair)
    reference: str  # what a verifier compares against (the number, the sentence)
    # with tools: the messages that answer the prompt (the assistant's calls, the tools'
    # results, then `answer`), and the names of the tools offered (lathe.data.tools)
    reply: tuple[dict[str, Any], ...] = ()
    tools: tuple[str, ...] = ()


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


def split_of(question: str) -> str:
    return "test" if zlib.crc32(question.encode()) % 1000 < HELDOUT_PER_MILLE else "train"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"split={split!r}: choose one of {', '.join(SPLITS)}")


def task_examples(name: str, split: str, limit: int | None = None) -> list[TaskExample]:
    """Rows of an embedded task (`arithmetic`, `arithmetic3`, `arithmetic3x3`, the last two
    answered through the calculator as `arithmetic3_tool` and `arithmetic3x3_tool`, or
    `stdlib_qa`), or of a mixture `A+B`: every row of each, interleaved in a seeded order,
    then cut to `limit`."""
    from lathe.data.tasks.arithmetic import (
        arithmetic3_examples,
        arithmetic3x3_examples,
        arithmetic_examples,
        with_calculator,
    )
    from lathe.data.tasks.stdlib_qa import stdlib_qa_examples
    # each task's problems, and what answers them through a tool (run after a mixture's cut,
    # so that a limit pays only for the rows it keeps: the calculator takes ~45 us a row)
    tasks: dict[str, tuple[Callable[[str, int | None], list[TaskExample]],
                           Callable[[TaskExample], TaskExample] | None]] = {
        "arithmetic": (arithmetic_examples, None), "arithmetic3": (arithmetic3_examples, None),
        "arithmetic3x3": (arithmetic3x3_examples, None),
        "arithmetic3_tool": (arithmetic3_examples, with_calculator),
        "arithmetic3x3_tool": (arithmetic3x3_examples, with_calculator),
        "stdlib_qa": (stdlib_qa_examples, None)}
    names = name.split("+")
    unknown = [n for n in names if n not in tasks]
    if unknown:
        raise ConfigError(f"unknown task {unknown[0]!r} in {name!r}; choose one of "
                          f"{', '.join(tasks)}, or several joined by '+'")
    check_split(split)
    mixture = len(names) > 1
    drawn = [(tasks[n][1], row) for n in names
             for row in tasks[n][0](split, None if mixture else limit)]
    if mixture:
        random.Random(0).shuffle(drawn)
        drawn = drawn[:limit]
    return [finish(row) if finish else row for finish, row in drawn]
