"""How long jobs report to a person: one progress-bar style (rate and ETA, resized with the
terminal, off when not wanted), W&B that logs offline unless a key or mode is set, and
quiet imports of libraries whose import-time log lines mean nothing to the run."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
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


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """Only errors from the named loggers inside the block (e.g. around an import whose
    warnings concern features the run does not use)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
