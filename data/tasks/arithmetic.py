"""Addition and subtraction of numbers up to two digits, e.g. "What is 47 + 85?" -> "132".

All 15,050 problems exist in a fixed shuffled order; about 10 % are held out by a hash
of the question. The answer is verifiable by `extract_number`.
"""

from __future__ import annotations

import random
import re

from lathe.data.tasks import PreferencePair, TaskExample, split_of

MAX_OPERAND = 99  # two-digit operands: 10,000 sums and 5,050 non-negative differences
NUMBER = re.compile(r"-?\d+")


def all_problems() -> list[tuple[str, int]]:
    """Every problem, in a fixed seeded order."""
    problems = [(f"What is {a} + {b}?", a + b)
                for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    problems += [(f"What is {a} - {b}?", a - b)
                 for a in range(MAX_OPERAND + 1) for b in range(a + 1)]
    random.Random(1234).shuffle(problems)
    return problems


def arithmetic_examples(split: str, limit: int | None = None) -> list[TaskExample]:
    rows = [TaskExample(question, str(result), str(result))
            for question, result in all_problems() if split_of(question) == split]
    return rows[:limit]


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
