"""Resumable training state: `<out_dir>/state/step-NNNNNNNN/` folders, written atomically by
all ranks together, the newest K kept.

A state folder holds what `accelerator.save_state` writes for the current parallel setup
(model and optimizer — sharded for FSDP2 and DeepSpeed —, RNG states per rank, the
accumulation counter) plus `trainer_state.json` (step, tokens seen, dataloader position,
anything the stage adds). All ranks write into one hidden `.step-N.tmp` folder; rank 0
publishes it by a rename only after every rank has finished, so a folder named `step-N`
is always complete and a run killed at any moment resumes from the newest one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from lathe.model.atomic import publish_directory, write_json
from lathe.model.recipe import ConfigError

STATE_DIR = "state"
TRAINER_STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"step-(\d{8})")


def step_dir(out_dir: Path, step: int) -> Path:
    return out_dir / STATE_DIR / f"step-{step:08d}"


def complete_states(out_dir: Path) -> list[Path]:
    """Published state folders, oldest first."""
    root = out_dir / STATE_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if _STEP_DIR.fullmatch(p.name) and (p / TRAINER_STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_resume(out_dir: Path, resume: str) -> Path | None:
    """`never` -> None; `auto` -> the newest complete state (None if there is none);
    anything else is a state folder path that must exist."""
    if resume == "never":
        return None
    if resume == "auto":
        states = complete_states(out_dir)
        return states[-1] if states else None
    path = Path(resume)
    if not (path / TRAINER_STATE_FILE).is_file():
        raise ConfigError(f"--resume {resume}: not a complete training-state folder (no "
                          f"{TRAINER_STATE_FILE}); use --resume auto or a {STATE_DIR}/step-N path")
    return path


def save_state(accelerator: Accelerator, out_dir: Path, step: int,
               trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Write the full training state for `step` (collective: every rank must call it)."""
    final = step_dir(out_dir, step)
    tmp = final.parent / f".{final.name}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_json(tmp / TRAINER_STATE_FILE, {"step": step, **trainer_state})
        publish_directory(tmp, final)
        for old in complete_states(out_dir)[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_state(accelerator: Accelerator, path: Path) -> dict[str, Any]:
    """Restore model, optimizer and RNG from `path`; return its trainer_state.json."""
    accelerator.load_state(str(path))
    return json.loads((path / TRAINER_STATE_FILE).read_text())


def remove_partial_states(accelerator: Accelerator, out_dir: Path) -> None:
    """Delete `.step-N.tmp` folders left by a run that died while saving."""
    if accelerator.is_main_process and (out_dir / STATE_DIR).is_dir():
        for leftover in (out_dir / STATE_DIR).glob(".step-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    accelerator.wait_for_everyone()
