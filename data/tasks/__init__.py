"""Embedded post-training tasks, generated deterministically so every machine trains and
evaluates on the same rows: multi-digit arithmetic with verifiable answers, questions
about standard-library functions answered by their docstrings' first sentence, and
preference pairs (the right answer chosen over a wrong one). Every task has a `train`
and a held-out `test` split, decided by a hash of the question."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

from lathe.core.errors import ConfigError

SPLITS = ("train", "test")
HELDOUT_PER_MILLE = 100  # 10 % of questions are held out


@dataclass(frozen=True)
class TaskExample:
    prompt: str  # the user's message
    answer: str  # the assistant's reply (SFT target, chosen side of a preference pair)
    reference: str  # what a verifier compares against (the number, the sentence)


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
    """Rows of an embedded task (`arithmetic` or `stdlib_qa`)."""
    from lathe.data.tasks.arithmetic import arithmetic_examples
    from lathe.data.tasks.stdlib_qa import stdlib_qa_examples
    tasks: dict[str, Callable[[str, int | None], list[TaskExample]]] = {
        "arithmetic": arithmetic_examples, "stdlib_qa": stdlib_qa_examples}
    if name not in tasks:
        raise ConfigError(f"unknown task {name!r}; choose one of {', '.join(tasks)}")
    check_split(split)
    return tasks[name](split, limit)
