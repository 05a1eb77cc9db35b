"""Verifiable rewards for GRPO and task accuracy: a registry of small functions
`(completion, reference) -> float`, and loading a user's own by `module:function` (one
that also takes `messages` is given the whole episode's, tool calls and results included)."""

from __future__ import annotations

import re
from collections.abc import Callable

from lathe.core.errors import ConfigError
from lathe.data.tasks.arithmetic import extract_number
from lathe.data.tools import import_function

Reward = Callable[[str, str], float]


def exact_number(completion: str, reference: str) -> float:
    """1 when the completion's last integer equals the reference number."""
    return float(extract_number(completion) == int(reference))


def digit_match(completion: str, reference: str) -> float:
    """Partial credit for arithmetic: the share of place values (units, tens, ...) where the
    completion's last integer has the reference's digit, over the longer of the two
    numbers; 0 without a number or with the wrong sign. Beside `exact_number` it gives a
    rollout group that is all wrong an advantage signal: nearer misses score higher."""
    found, want = extract_number(completion), int(reference)
    if found is None or (found < 0) != (want < 0):
        return 0.0
    got, ref = str(abs(found))[::-1], str(abs(want))[::-1]
    matched = sum(a == b for a, b in zip(got, ref, strict=False))  # missing places score 0
    return matched / max(len(got), len(ref))


def exact_text(completion: str, reference: str) -> float:
    """1 when the completion equals the reference up to surrounding whitespace."""
    return float(" ".join(completion.split()) == " ".join(reference.split()))


def number_only_format(completion: str, reference: str) -> float:
    """1 when the completion is just an integer (the answer format the task asks for)."""
    return float(re.fullmatch(r"\s*-?\d+\s*", completion) is not None)


def length_penalty(completion: str, reference: str) -> float:
    """-1 per 100 characters beyond the reference's length (discourages rambling)."""
    return -max(len(completion) - len(reference), 0) / 100


REWARDS: dict[str, Reward] = {"exact_number": exact_number, "digit_match": digit_match,
                              "exact_text": exact_text,
                              "number_only_format": number_only_format,
                              "length_penalty": length_penalty}
VERIFIERS: dict[str, Reward] = {"arithmetic": exact_number, "arithmetic3": exact_number,
                                "arithmetic3x3": exact_number, "arithmetic3_tool": exact_number,
                                "arithmetic3x3_tool": exact_number, "stdlib_qa": exact_text}


def load_reward(name: str) -> Reward:
    """A registered reward, or `package.module:function` for one of your own."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise ConfigError(f"reward {name!r}: not one of {', '.join(REWARDS)} and not a "
                          "module:function import path")
    return import_function(name, "reward")


def verifier(task: str) -> Reward:
    if task not in VERIFIERS:
        raise ConfigError(f"task_eval.task={task!r}: choose one of {', '.join(VERIFIERS)}")
    return VERIFIERS[task]
