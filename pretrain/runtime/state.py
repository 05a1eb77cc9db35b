"""Resumable training state: `<out_dir>/state/step-NNNNNNNN/` folders, written atomically by
all ranks together, the newest K kept.

A state folder holds what `accelerator.save_state` writes for the current parallel setup
(model and optimizer — sharded for FSDP2 and DeepSpeed —, RNG states per rank, the
accumulation counter) plus `trainer_state.json` (step, tokens seen, dataloader position,
anything the stage adds, and the size of every file the ranks wrote).

The rules that make a run killed at any moment resume from the newest complete state:
- every rank writes into one hidden `.step-N.tmp` folder; rank 0 publishes it by a rename
  only after a barrier that every rank reaches after its own part is on disk;
- an old state is retired by renaming it hidden before deleting it, so a half-deleted
  folder never carries a `step-N` name;
- `--resume auto` checks a candidate against the file list in its trainer_state.json and
  skips (with the reason printed) one that is not whole; rank 0 decides and every rank
  loads what it decided;
- hidden leftovers of a killed save or rotation are removed at start, with a message.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from lathe.core.atomic import publish_directory, write_json
from lathe.core.errors import ConfigError
from lathe.core.failpoints import failpoint

STATE_DIR = "state"
TRAINER_STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"step-(\d{8})")


def step_dir(out_dir: Path, step: int) -> Path:
    return out_dir / STATE_DIR / f"step-{step:08d}"


def published_states(out_dir: Path) -> list[Path]:
    """State folders under their final `step-N` name, oldest first."""
    root = out_dir / STATE_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir()),
                  key=lambda p: p.name)


def incomplete_reason(path: Path) -> str | None:
    """Why the state folder `path` cannot be resumed from, or None when it is whole."""
    try:
        trainer_state = json.loads((path / TRAINER_STATE_FILE).read_text())
    except FileNotFoundError:
        return f"no {TRAINER_STATE_FILE}"
    except (OSError, ValueError) as error:
        return f"unreadable {TRAINER_STATE_FILE}: {error}"
    files = trainer_state.get("files") if isinstance(trainer_state, dict) else None
    if not isinstance(files, dict):
        return f"{TRAINER_STATE_FILE} has no file list"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def resolve_resume(out_dir: Path, resume: str,
                   report: Callable[[str], None] = print) -> Path | None:
    """`never` -> None; `auto` -> the newest whole state (None if there is none), reporting
    each newer one it skips; anything else is a state folder that must be whole."""
    if resume == "never":
        return None
    if resume == "auto":
        for path in reversed(published_states(out_dir)):
            reason = incomplete_reason(path)
            if reason is None:
                return path
            report(f"resume: skipping {path}: {reason}")
        return None
    path = Path(resume)
    reason = incomplete_reason(path)
    if reason is not None:
        raise ConfigError(f"--resume {resume}: not a complete training-state folder ({reason});"
                          f" use --resume auto or another {STATE_DIR}/step-N folder")
    return path


def choose_resume(accelerator: Accelerator, out_dir: Path, resume: str,
                  report: Callable[[str], None] = print) -> Path | None:
    """`resolve_resume` decided on rank 0 and shared, so every rank loads the same state
    (collective). Also clears the leftovers of a save or rotation that was killed."""
    choice: list[Any] = [None]
    if accelerator.is_main_process:
        remove_leftovers(out_dir, report)
        path = resolve_resume(out_dir, resume, report)
        choice = [None if path is None else str(path)]
    if accelerator.num_processes > 1:
        broadcast_object_list(choice, from_process=0)
    return None if choice[0] is None else Path(choice[0])


def save_state(accelerator: Accelerator, out_dir: Path, step: int,
               trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Write the full training state for `step` (collective: every rank must call it)."""
    final = step_dir(out_dir, step)
    tmp = final.parent / f".{final.name}.tmp"
    rank = accelerator.process_index
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    failpoint("save-shard", step, rank)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json(tmp / TRAINER_STATE_FILE,
                   {"step": step, **trainer_state, "files": _file_sizes(tmp)})
        failpoint("save-publish", step, rank)
        publish_directory(tmp, final)
        for old in published_states(out_dir)[:-keep_last]:
            _retire(old, step, rank)
    accelerator.wait_for_everyone()
    return final


def load_state(accelerator: Accelerator, path: Path) -> dict[str, Any]:
    """Restore model, optimizer and RNG from `path`; return its trainer_state.json."""
    accelerator.load_state(str(path))
    trainer_state = json.loads((path / TRAINER_STATE_FILE).read_text())
    trainer_state.pop("files", None)
    return trainer_state


def remove_leftovers(out_dir: Path, report: Callable[[str], None] = print) -> None:
    """Delete the hidden folders a killed save (`.step-N.tmp`) or rotation left behind."""
    root = out_dir / STATE_DIR
    if not root.is_dir():
        return
    for leftover in sorted(root.glob(".step-*")):
        report(f"resume: removing {leftover.name}, left by a run killed while saving or "
               "deleting a state")
        shutil.rmtree(leftover, ignore_errors=True)


def _file_sizes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size
            for p in sorted(root.rglob("*")) if p.is_file()}


def _retire(path: Path, step: int, rank: int) -> None:
    hidden = path.parent / f".{path.name}.old"
    os.replace(path, hidden)
    failpoint("save-rotate", step, rank)
    shutil.rmtree(hidden)
