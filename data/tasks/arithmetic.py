"""Addition and subtraction with verifiable answers: `arithmetic`, numbers up to two digits
("What is 47 + 85?" -> "132"); `arithmetic3`, up to three digits ("What is 604 - 87?" ->
"517"); and `arithmetic3x3`, the slice of `arithmetic3` whose operands both have three digits
("What is 604 - 387?" -> "217"), its hardest problems, where a model that has not finished
learning the carry fails most. `arithmetic3_tool` and `arithmetic3x3_tool` are the same
problems (and splits) answered through the calculator tool: the assistant calls
`calculator` with the question's expression, reads its result and answers with it.

All 15,050 two-digit problems exist in a fixed shuffled order; the three-digit task is a
fixed seeded sample of 60,000 of its ~1.5 million. About 10 % of each are held out by a
hash of the question. The answer is verifiable by `extract_number`.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Iterable

from lathe.data.calculator import calculator
from lathe.data.tasks import PreferencePair, TaskExample, split_of

MAX_OPERAND = 99  # two-digit operands: 10,000 sums and 5,050 non-negative differences
THREE_DIGIT_PROBLEMS = 60_000
NUMBER = re.compile(r"-?\d+")


@functools.cache
def all_problems() -> tuple[tuple[str, int], ...]:
    """Every problem, in a fixed seeded order (made once a process: each evaluation asks)."""
    problems = [(f"What is {a} + {b}?", a + b)
                for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    problems += [(f"What is {a} - {b}?", a - b)
                 for a in range(MAX_OPERAND + 1) for b in range(a + 1)]
    random.Random(1234).shuffle(problems)
    return tuple(problems)


@functools.cache
def three_digit_problems() -> tuple[tuple[str, int], ...]:
    """A fixed seeded sample of sums and non-negative differences of operands up to 999,
    half of each. Each operand's digit count (1-3) is drawn uniformly before its value, so
    every alignment of digits (347 + 5, 62 - 48, 9 + 610) is common; a uniform draw from
    0-999 makes 81 % of problems three digits by three, and a model trained on it fails
    most of the rest (docs/readme-run-quality.md, seventh round)."""
    rng = random.Random(4321)

    def operand() -> int:
        digits = rng.randint(1, 3)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)

    problems: dict[str, int] = {}
    while len(problems) < THREE_DIGIT_PROBLEMS:
        a, b = operand(), operand()
        if rng.random() < 0.5:
            problems.setdefault(f"What is {a} + {b}?", a + b)
        else:
            a, b = max(a, b), min(a, b)
            problems.setdefault(f"What is {a} - {b}?", a - b)
    return tuple(problems.items())


def _examples(problems: Iterable[tuple[str, int]], split: str,
              limit: int | None) -> list[TaskExample]:
    rows = [TaskExample(question, str(result), str(result))
            for question, result in problems if split_of(question) == split]
    return rows[:limit]


def arithmetic_examples(split: str, limit: int | None = None) -> list[TaskExample]:
    return _examples(all_problems(), split, limit)


def arithmetic3_examples(split: str, limit: int | None = None) -> list[TaskExample]:
    return _examples(three_digit_problems(), split, limit)


def arithmetic3x3_examples(split: str, limit: int | None = None) -> list[TaskExample]:
    """The three-digit-by-three-digit problems of `arithmetic3`, in the same split (a
    question is held out in both tasks or in neither)."""
    problems = [(question, result) for question, result in three_digit_problems()
                if all(len(operand) == 3 for operand in NUMBER.findall(question))]
    return _examples(problems, split, limit)


def with_calculator(row: TaskExample) -> TaskExample:
    """The problem answered through the calculator: a call with the question's expression,
    the tool's result (computed here by the tool itself), then the result as the answer."""
    expression = row.prompt.removeprefix("What is ").removesuffix("?")
    result = calculator(expression)
    call = {"type": "function", "id": "call_0",
            "function": {"name": "calculator", "arguments": {"expression": expression}}}
    reply = ({"role": "assistant", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_0", "name": "calculator",
              "content": result},
             {"role": "assistant", "content": result})
    return TaskExample(row.prompt, result, row.reference, reply, ("calculator",))


def extract_number(text: str) -> int | None:
    """The last integer in a completion (how arithmetic answers are verified)."""
    found = NUMBER.findall(text)
    return int(found[-1]) if found else None


def _preferences(rows: list[TaskExample]) -> list[PreferencePair]:
    """The right result chosen over a near miss (off by 1-10, or a carry error of 10/100)."""
    rng = random.Random(99)
    pairs = []
    for row in rows:
        right = int(row.reference)
        wrong = right + rng.choice([-100, -10, -1, 1, 10, 100, rng.randint(2, 9)])
        pairs.append(PreferencePair(row.prompt, row.answer, str(wrong)))
    return pairs


def arithmetic_preferences(split: str, limit: int | None = None) -> list[PreferencePair]:
    return _preferences(arithmetic_examples(split, limit))


def arithmetic3_preferences(split: str, limit: int | None = None) -> list[PreferencePair]:
    return _preferences(arithmetic3_examples(split, limit))
