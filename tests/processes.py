"""Subprocesses started by tests: each has a time limit, takes its whole process tree down
when it runs past it, and fails the test with everything it printed.

`accelerate launch` (torchrun) starts each rank in a session of its own, so killing the
launcher's process group is not enough to stop a run; `kill_tree` walks /proc instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue.extend(children.get(child, []))
    return found


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie awaiting its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def running(marker: bytes) -> list[int]:
    """Every live process whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or not alive(int(entry.name)):
            continue
        try:
            if marker in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return found


def kill_tree(pid: int) -> None:
    for target in [*descendants(pid), pid]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(cmd: Sequence[str], timeout: float, check: bool = True,
        **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd` to the end within `timeout` seconds and return its result (text output).
    The test fails, with the full output, on a timeout or (with `check`) a non-zero exit."""
    start = time.monotonic()
    process = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # not reaped yet, so its pid is still its own
        kill_tree(process.pid)
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))}\ntimed out after {timeout:.0f} s\n"
                    f"--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}", pytrace=False)
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))}\nexited {result.returncode} after "
                    f"{time.monotonic() - start:.0f} s\n--- stdout ---\n{stdout}\n"
                    f"--- stderr ---\n{stderr}", pytrace=False)
    return result
