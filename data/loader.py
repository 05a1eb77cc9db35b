"""The packed pretraining dataloader: token shards viewed as one stream, cut into
(T + 1)-token windows (inputs and shifted labels) that ignore document boundaries, as
GPT-style pretraining does; the separator token marks where documents meet
(`window_documents` turns it into per-token document ids, for document masking).

Each epoch visits every window once in an order fixed by (seed, epoch). A step takes
`batch_size × world_size` consecutive windows of that order and rank r gets its own
`batch_size` of them, so ranks never overlap. `state_dict()` is (epoch, step), so a
resumed run gets exactly the batch it would have got next.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lathe.core.errors import ConfigError
from lathe.data.shards import load_meta, read_shard


def window_documents(batch: torch.Tensor, separator: int) -> torch.Tensor:
    """(B, T) document ids of windows: a new document at each `separator` token."""
    return (batch == separator).cumsum(dim=1)


class PackedLoader:
    def __init__(self, folder: str | Path, split: str, batch_size: int, seq_len: int,
                 seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        meta = load_meta(folder)
        if split not in meta["splits"]:
            raise ConfigError(f"split {split!r} not in {folder}; choose {list(meta['splits'])}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}")
        self.separator: int | None = meta.get("bos_token_id")  # each document's first token
        self.shards = [s for s in (read_shard(Path(folder) / f)
                                   for f in meta["splits"][split]["files"]) if len(s)]
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.n_windows = max(int(self.offsets[-1]) - 1, 0) // seq_len
        self.steps_per_epoch = self.n_windows // (batch_size * world_size)
        if self.steps_per_epoch < 1:
            raise ConfigError(
                f"the {split} split of {folder} has {int(self.offsets[-1]):,} tokens, fewer "
                f"than one step needs (batch_size {batch_size} × world_size {world_size} × "
                f"(seq_len {seq_len} + 1)); lower batch_size or seq_len, or add data")
        self.epoch = self.step = 0
        self._order: np.ndarray | None = None

    @property
    def tokens_per_epoch(self) -> int:
        return self.steps_per_epoch * self.batch_size * self.world_size * self.seq_len

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order = rng.permutation(self.n_windows)
        return self._order

    def _window(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        stop = start + self.seq_len + 1
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces, shard = [], first
        while start < stop:
            local = start - int(self.offsets[shard])
            take = min(stop - start, len(self.shards[shard]) - local)
            pieces.append(self.shards[shard][local:local + take])
            start += take
            shard += 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def next_batch(self) -> torch.Tensor:
        """(batch_size, seq_len + 1) int64 token ids for this rank."""
        if self.step == self.steps_per_epoch:
            self.epoch, self.step, self._order = self.epoch + 1, 0, None
        per_step = self.batch_size * self.world_size
        begin = self.step * per_step + self.rank * self.batch_size
        indices = self._epoch_order()[begin:begin + self.batch_size]
        batch = np.stack([self._window(int(i)) for i in indices]).astype(np.int64)
        self.step += 1
        return torch.from_numpy(batch)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed,
                "batch_size": self.batch_size, "seq_len": self.seq_len,
                "world_size": self.world_size, "n_windows": self.n_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "batch_size", "seq_len", "world_size", "n_windows"):
            if state[key] != getattr(self, key):
                raise ConfigError(f"dataloader state has {key}={state[key]} but this loader "
                                  f"has {getattr(self, key)}; resume with the same data and "
                                  "batch settings")
        self.epoch, self.step, self._order = state["epoch"], state["step"], None
