"""Where the benchmark scripts (`python -m lathe.<package>.bench`) keep their tables: each
run's table is appended to `benchmarks-history.md` in a run folder (`--out`, by default
`runs/bench` under the working directory), never inside the installed package. From a
checkout's root, `--out docs` adds it to the project's own history."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_OUT = Path("runs/bench")
HISTORY = "benchmarks-history.md"


def add_history_arguments(parser: argparse.ArgumentParser) -> None:
    """`--out DIR` and `--no-write` (print the table only)."""
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"folder whose {HISTORY} the table is appended to (default: "
                             f"{DEFAULT_OUT}; `--out docs` in a checkout: the project's)")
    parser.add_argument("--no-write", action="store_true", help="only print the table")


def history_folder(args: argparse.Namespace) -> Path | None:
    """Where `add_history_arguments`' flags send the table (None: nowhere)."""
    return None if args.no_write else args.out


def record(table: str, out: Path | None) -> None:
    """Append `table` to `out`'s history (nothing when `out` is None)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    path = out / HISTORY
    with path.open("a") as f:
        f.write("\n" + table.rstrip("\n") + "\n")
    print(f"(appended to {path})")
