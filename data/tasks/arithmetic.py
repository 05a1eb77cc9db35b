"""Addition and subtraction of multi-digit numbers, e.g. "What is 47 + 385?" -> "432".

Problems come from a seeded stream; the answer is verifiable by `extract_number`.
"""

from __future__ import annotations

import random
import re

from lathe.data.tasks import PreferencePair, TaskExample, split_of

MAX_DIGITS = 3
NUMBER = re.compile(r"-?\d+")


def problem(rng: random.Random) -> tuple[str, int]:
    a = rng.randint(0, 10 ** rng.randint(1, MAX_DIGITS) - 1)
    b = rng.randint(0, 10 ** rng.randint(1, MAX_DIGITS) - 1)
    if rng.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    a, b = max(a, b), min(a, b)
    return f"What is {a} - {b}?", a - b


def arithmetic_examples(split: str, limit: int | None = None) -> list[TaskExample]:
    limit = limit if limit is not None else (20000 if split == "train" else 500)
    rng = random.Random(1234)
    seen: set[str] = set()
    rows = []
    while len(rows) < limit:
        question, result = problem(rng)
        if question in seen or split_of(question) != split:
            continue
        seen.add(question)
        rows.append(TaskExample(question, str(result), str(result)))
    return rows


def extract_number(text: str) -> int | None:
    """The last integer in a completion (how arithmetic answers are verified)."""
    found = NUMBER.findall(text)
    return int(found[-1]) if found else None


def arithmetic_preferences(split: str, limit: int | None = None) -> list[PreferencePair]:
    """The right result chosen over a near miss (off by 1-10, or a carry error of 10/100)."""
    rng = random.Random(99)
    pairs = []
    for row in arithmetic_examples(split, limit):
        right = int(row.reference)
        wrong = right + rng.choice([-100, -10, -1, 1, 10, 100, rng.randint(2, 9)])
        pairs.append(PreferencePair(row.prompt, row.answer, str(wrong)))
    return pairs
