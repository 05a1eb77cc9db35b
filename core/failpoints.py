"""Deterministic crash points, so resume can be tested at every moment that matters.

`LATHE_FAILPOINT=PHASE@STEP[@RANK]` makes the process of rank RANK (every rank when left
out) SIGKILL itself when it reaches PHASE at step STEP — no cleanup, no flushing, as a
preemption or an OOM kill would end it. Under `accelerate launch` the launcher then
takes the other ranks down, wherever they are. Training phases, in the order a step
meets them (STEP is the training step):

- `step`: mid optimizer step, after the first micro-batch's backward;
- `eval`: mid evaluation, after the validation loss, before the samples;
- `save-shard`: this rank has written its part of the state, other ranks may not have;
- `save-publish`: every part and trainer_state.json are written, the folder is unpublished;
- `save-rotate`: the new state is published, an old one is hidden but not yet deleted.

`lathe clean`'s phases, in run order (STEP counts shards or parts; rank 0):

- `clean-shard`: STEP input shards are cleaned and recorded, the rest are not;
- `clean-dedup`: the dedup decision is recorded, no output part is written yet;
- `clean-part`: output parts 0 to STEP are final, the rest still in the work folder;
- `clean-stats`: stats.json is written, the work folder is not yet removed.

Unset (the default), a failpoint costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "LATHE_FAILPOINT"
PHASES = ("step", "eval", "save-shard", "save-publish", "save-rotate",
          "clean-shard", "clean-dedup", "clean-part", "clean-stats")


def check_env() -> None:
    """Refuse a malformed `LATHE_FAILPOINT` when a run starts, not at its first failpoint."""
    if os.environ.get(ENV):
        parse(os.environ[ENV])


def failpoint(phase: str, step: int, rank: int) -> None:
    """SIGKILL this process if `LATHE_FAILPOINT` names this phase, step and rank."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want_phase, want_step, want_rank = parse(spec)
    if phase == want_phase and step == want_step and want_rank in (None, rank):
        print(f"lathe failpoint: SIGKILL at {phase}@{step} on rank {rank}", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def parse(spec: str) -> tuple[str, int, int | None]:
    parts = spec.split("@")
    if len(parts) not in (2, 3) or parts[0] not in PHASES or not all(
            p.isdigit() for p in parts[1:]):
        raise ValueError(f"{ENV}={spec!r}: expected PHASE@STEP[@RANK] with PHASE one of "
                         f"{', '.join(PHASES)}, e.g. save-shard@16@1; unset it to run normally")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None
