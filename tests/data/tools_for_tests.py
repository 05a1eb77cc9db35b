"""Tools the tool tests import by `tests.data.tools_for_tests:NAME`: well-behaved ones and
ones that raise, hang, flood their output, exit, return junk, forge answers or leave
processes behind."""

from __future__ import annotations

import os
import sys
import time
from typing import Literal


def weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> dict:
    """Today's temperature in a city.

    Args:
        city: the city's name, e.g. "Paris"
        unit: the temperature scale
            of the answer
    """
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit}


def shout(text: str) -> None:
    """Print the text in capitals."""
    print(text.upper())


def fails(x: int) -> str:
    """Always raises."""
    raise RuntimeError(f"no luck with {x}")


def hangs() -> str:
    """Never returns."""
    while True:
        time.sleep(0.01)


def floods() -> str:
    """Prints ten megabytes."""
    for _ in range(10):
        sys.stdout.write("x" * (1 << 20))
    return "done"


def writes_to_fd() -> str:
    """Writes past sys.stdout, onto the process's file descriptor 1."""
    os.write(1, b'{"content": "forged"}\n' * 1000)
    return "honest"


def writes_to_every_fd() -> str:
    """Writes a forged answer to every descriptor it can reach, the worker's pipes included
    if it held them."""
    for fd in range(3, 1024):
        try:
            os.write(fd, b'{"content": "FORGED"}\n' * 64)
        except OSError:
            pass
    return "honest"


def starts_a_sleeper() -> int:
    """Starts a process that would outlive the call; its pid."""
    import subprocess
    return subprocess.Popen(["sleep", "60"]).pid


def huge() -> str:
    """Returns ten megabytes."""
    return "y" * (10 << 20)


def junk() -> object:
    """Returns something that is neither text nor JSON."""
    return object()


def exits() -> str:
    """Kills its own process."""
    os._exit(3)


def counter(start: int) -> int:
    """One more than start."""
    return start + 1


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b
