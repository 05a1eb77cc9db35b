"""`lathe clean --executor ray`: the same clean run on a Ray cluster, through Ray Data.

Each input shard is one row of a Ray dataset, mapped by an actor that holds the same
`Pipeline` (the same stage objects) the local workers hold, writing the same per-shard
part and statistics files, so resume-by-shard works as it does locally. Dedup runs as
distributed steps:

1. signatures: each part's exact keys and MinHash band keys, one task per part;
2. bucket shuffle: (key, document index) rows grouped by key (exact) or by (band, key)
   (near) with `groupby().map_groups`, so all copies of a key meet in one group;
3. resolution: per group, the lowest index of each exact key, or the LSH edges joining the
   documents that share a band key; the driver unions the edges into clusters and keeps
   the lowest index of each — the kept set the local executor computes.

Every Ray worker must read and write `--output` (one machine, or a shared filesystem on a
multi-node cluster; see docs/data-at-scale.md). `ray` is the optional extra
`pip install -e .[distributed]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lathe.core.errors import ConfigError
from lathe.data.dedup import cluster_roots, first_indices, lsh_edges
from lathe.data.pipeline import CleanConfig
from lathe.data.runner import Executor, PartSignature, part_signature


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--executor ray needs Ray: pip install -e '.[distributed]'") from None
    return ray


class _CleanShards:
    """A Ray Data actor: one `Pipeline` per actor, as one per local worker process."""

    def __init__(self, config: CleanConfig, pending: list) -> None:
        from lathe.data import runner

        runner.init_worker(config)
        self.clean, self.pending = runner.clean_shard, pending

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        index, docs = self.clean(self.pending[row["job"]])
        return {"shard": index, "docs": docs}


class RayExecutor(Executor):
    def __init__(self, address: str | None = None, num_cpus: int | None = None,
                 buckets: int = 16) -> None:
        """Join the cluster at `address` (e.g. `ray://head:10001`, or `auto`), or start a
        local Ray with `num_cpus` when None. `buckets`: partitions of each dedup shuffle
        (more on a bigger cluster)."""
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=address, num_cpus=None if address else num_cpus,
                     include_dashboard=False, log_to_driver=False)
        self.ray, self.buckets = ray, buckets

    def _progress_bars(self, progress: bool) -> None:
        context = self.ray.data.DataContext.get_current()
        context.enable_progress_bars = progress

    def run_shards(self, pending: list, total: int, config: CleanConfig,
                   progress: bool) -> None:
        if not pending:
            return
        self._progress_bars(progress)
        jobs = self.ray.data.from_items([{"job": i} for i in range(len(pending))],
                                        override_num_blocks=len(pending))
        workers = max(1, min(config.num_proc, len(pending)))
        jobs.map(_CleanShards, fn_constructor_args=(config, pending),
                 concurrency=workers).materialize()

    def signatures(self, parts: list[Path], config: CleanConfig,
                   progress: bool) -> list[PartSignature]:
        task = self.ray.remote(part_signature)
        return self.ray.get([task.remote(str(p), config) for p in parts])

    def first_occurrences(self, keys: np.ndarray, index: np.ndarray) -> np.ndarray:
        rows = self.ray.data.from_numpy(np.stack([keys.view(np.int64), index], axis=1))
        firsts = rows.map_batches(_columns(("key", "index"))).groupby(
            "key", num_partitions=self.buckets).map_groups(_first_in_group, batch_format="numpy")
        (first,) = _gather(firsts, ("index",))
        return np.isin(index, first)

    def near_duplicate_mask(self, bands: np.ndarray, index: np.ndarray) -> np.ndarray:
        n, width = bands.shape
        table = np.stack([np.repeat(index, width), np.tile(np.arange(width), n),
                          bands.reshape(-1).view(np.int64)], axis=1)
        rows = self.ray.data.from_numpy(table).map_batches(_columns(("index", "band", "key")))
        edges = rows.groupby(["band", "key"], num_partitions=self.buckets).map_groups(
            _edges_in_group, batch_format="numpy")
        return cluster_roots(index, np.stack(_gather(edges, ("a", "b")), axis=1))


def _columns(names: tuple[str, ...]) -> Any:
    def split(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        data = batch["data"]
        return {name: data[:, i] for i, name in enumerate(names)}
    return split


def _first_in_group(group: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(group["index"], kind="stable")
    return {"index": first_indices(group["key"][order], group["index"][order])}


def _edges_in_group(group: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(group["index"], kind="stable")
    edges = lsh_edges(group["key"][order][:, None], group["index"][order])
    return {"a": edges[:, 0], "b": edges[:, 1]}


def _gather(dataset: Any, columns: tuple[str, ...]) -> list[np.ndarray]:
    """The columns of every row of `dataset` (run once), as int64 arrays."""
    batches = list(dataset.iter_batches(batch_format="numpy"))
    return [np.concatenate([b[c] for b in batches]).astype(np.int64) if batches
            else np.zeros(0, np.int64) for c in columns]
