"""How long jobs report to a person: one progress-bar style (rate and ETA, resized with the
terminal, off when not wanted) and W&B that logs offline unless a key or mode is set."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


def progress_bar(iterable: Iterable[Any] | None = None, *, desc: str, unit: str,
                 total: int | None = None, initial: int = 0, enabled: bool = True) -> tqdm:
    """A tqdm bar over `iterable` or counting to `total` (rate and ETA shown)."""
    return tqdm(iterable, total=total, initial=initial, desc=desc, unit=unit,
                dynamic_ncols=True, disable=not enabled)


def default_wandb_offline() -> None:
    """Log offline (to the run's folder) unless an API key or an explicit mode is set."""
    if "WANDB_MODE" in os.environ or os.environ.get("WANDB_API_KEY"):
        return
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text():
        return
    os.environ["WANDB_MODE"] = "offline"
