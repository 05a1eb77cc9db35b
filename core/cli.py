"""The `lathe` console script. Each package registers its own subcommands as entry points
(group `lathe.commands` in pyproject.toml, `name = "lathe.PACKAGE.module:function"`); this
module finds them without importing any of them, so `lathe --help` is instant and core
imports nothing of lathe. A subcommand's module is imported only when it runs."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import NoReturn

from lathe.core.errors import LatheError

GROUP = "lathe.commands"


def commands() -> dict[str, EntryPoint]:
    """Every registered subcommand, by name."""
    return {entry.name: entry for entry in entry_points(group=GROUP)}


def usage() -> str:
    by_package: dict[str, list[str]] = {}
    for name, entry in commands().items():
        package = entry.module.split(".")[1] if entry.module.startswith("lathe.") else entry.module
        by_package.setdefault(package, []).append(name)
    width = max(map(len, by_package), default=0) + 1
    lines = [f"  {package + ':':<{width}} {' '.join(sorted(by_package[package]))}"
             for package in sorted(by_package)]
    return ("usage: lathe COMMAND [ARGS ...]\n\nraw text to a served chat model\n\n"
            "commands, by the package that owns them:\n" + "\n".join(lines)
            + "\n\nRun `lathe COMMAND --help` for a command's options.")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands():
        print(f"lathe: unknown command {name!r}; choose one of {', '.join(commands())}",
              file=sys.stderr)
        return 2
    return run_command(name, rest)


def run_command(name: str, argv: Sequence[str]) -> int:
    """Run subcommand `name`; a user-fixable error (`LatheError`: a bad config, checkpoint
    or input file) is one line on stderr and exit 2."""
    command = commands()[name].load()
    try:
        return command(list(argv))
    except LatheError as e:
        print(f"lathe {name}: error: {e}", file=sys.stderr)
        return 2


def exit_process(code: int) -> NoReturn:
    """End this process with `code`, the way every `python -m lathe...` entry point ends.

    A worker of a multi-process launch (WORLD_SIZE > 1) leaves with `os._exit` once its
    output is flushed. Its job is done and its process group destroyed, yet objects that
    outlive the job (a DeviceMesh, DeepSpeed's groups) can keep the gloo group alive into
    interpreter teardown, where its C++ threads now and then abort the process ("terminate
    called without an active exception", SIGABRT: pytorch/pytorch#190489) and fail a run
    that finished; CI saw it twice in one run, on a ZeRO-3 SFT and an FSDP2 probe."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # `python -m lathe.core.cli COMMAND ...`, as the `lathe` script
    exit_process(main())
