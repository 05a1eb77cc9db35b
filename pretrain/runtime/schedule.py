"""Learning-rate schedules as pure functions of the step, so resuming needs only the step."""

from __future__ import annotations

import math

from lathe.pretrain.runtime.config import ScheduleConfig


def lr_factor(step: int, total_steps: int, config: ScheduleConfig,
              cooldown: tuple[int, int] | None = None) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based) of `total_steps`.

    Warmup rises linearly to 1 over `warmup_steps` (first step at 1/warmup). Cosine then
    falls to `min_lr_ratio` at the last step; WSD holds 1 until the final `decay_fraction`
    of the run, then falls linearly to `min_lr_ratio`; constant stays at 1. A `cooldown`
    (start, end), begun when a held-out metric asked to stop, replaces the rest: from step
    `start` the factor falls linearly from its value there to `min_lr_ratio` at `end` —
    WSD's decay, started by the metric instead of the step count.
    """
    if cooldown is not None and step >= cooldown[0]:
        start, end = cooldown
        begin = lr_factor(start, total_steps, config)
        progress = min((step - start + 1) / max(end - start, 1), 1.0)
        return begin - (begin - config.min_lr_ratio) * progress
    warmup = config.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    floor = config.min_lr_ratio
    if config.kind == "constant":
        return 1.0
    if config.kind == "cosine":
        span = max(total_steps - 1 - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(round(config.decay_fraction * total_steps), 1)
    decay_start = max(total_steps - decay_steps, warmup)
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start + 1) / max(total_steps - decay_start, 1), 1.0)
    return 1.0 - (1 - floor) * progress
