"""`lathe clean`: runs the pipeline over every input shard in parallel, then dedups
across all of them, writing the output folder

    OUT/part-00000.parquet ...   cleaned, deduplicated documents (one part per input shard)
    OUT/stats.json               per-stage statistics of the whole run (written last)
    OUT/.work/                   per-shard results while the run is in progress

Every step is recorded atomically before the next begins, so a run killed at any moment
resumes where it stopped and produces the same output as an uninterrupted one: each
shard's result and statistics, then the dedup decision (`.work/keep.npy` and
`.work/dedup.json`), then each final part (its work file is removed once the part
is in place), then stats.json, and last the work folder's removal.
`LATHE_FAILPOINT=clean-...` kills a run at each of those moments (see
`lathe.core.failpoints`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lathe.core.atomic import atomic_file, write_json
from lathe.core.config import to_dict
from lathe.core.errors import ConfigError
from lathe.core.failpoints import check_env, failpoint
from lathe.core.reporting import progress_bar
from lathe.data.dedup import MinHasher, exact_key, first_occurrences, near_duplicate_mask
from lathe.data.pipeline import READ, CleanConfig, Pipeline
from lathe.data.sources import InputShard, list_shards, read_guarded
from lathe.data.stats import RunStats, StageStats, docs_out, merge_run_stats
from lathe.data.store import SUFFIX, read_documents, write_documents

WORK = ".work"


@dataclass
class CleanResult:
    stats: RunStats
    seconds: float
    output: Path


_pipeline: Pipeline | None = None


def init_worker(config: CleanConfig) -> None:
    global _pipeline
    _pipeline = Pipeline(config)
    if multiprocessing.parent_process() is not None:
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A worker outlives a killed `lathe clean` otherwise: it waits on a task queue whose
    write end it holds itself, keeping the run's output pipes (and memory) for good."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


def clean_shard(job: tuple[int, InputShard, str, str]) -> tuple[int, int]:
    index, shard, work, fmt = job
    stats = _pipeline.new_stats()
    docs = list(_pipeline.run(read_guarded(shard), stats))
    write_documents(Path(work) / f"{index:05d}{SUFFIX[fmt]}", docs, fmt)
    write_json(Path(work) / f"{index:05d}.stats.json",
                {name: s.to_dict() for name, s in stats.items()})
    return index, stats[READ].docs_in


def _read_stats(path: Path) -> RunStats:
    return {name: StageStats.from_dict(s) for name, s in json.loads(path.read_text()).items()}


def clean(input_spec: str, output: str | Path, config: CleanConfig,
          progress: bool = True, executor: Executor | None = None) -> CleanResult:
    """Clean `input_spec` into `output`; `executor` runs the shards and the dedup steps
    (default: worker processes on this machine; `lathe.data.ray_executor` for Ray)."""
    check_env()
    executor = executor or LocalExecutor()
    start = time.perf_counter()
    output, work = Path(output), Path(output) / WORK
    finished = (output / "stats.json").exists()
    if finished and not work.exists():
        raise ConfigError(f"--output {str(output)!r} already holds a finished run "
                          "(stats.json); choose a new folder or delete it")
    shards = list_shards(input_spec, config.source)
    manifest = {"input": input_spec, "shards": [s.name for s in shards],
                "config": to_dict(config)}
    if (work / "manifest.json").exists():
        if json.loads((work / "manifest.json").read_text()) != manifest:
            raise ConfigError(f"--output {str(output)!r} holds an unfinished run with another "
                              "input or recipe; resume it with the same ones or use a new folder")
    else:
        write_json(work / "manifest.json", manifest)
    if finished:  # killed after stats.json, before the work folder was removed
        shutil.rmtree(work)
        summary = json.loads((output / "stats.json").read_text())
        return CleanResult({n: StageStats.from_dict(s) for n, s in summary["stages"].items()},
                           summary["seconds"], output)

    pending = [(i, s, str(work), config.output_format) for i, s in enumerate(shards)
               if not (work / f"{i:05d}.stats.json").exists()]
    executor.run_shards(pending, len(shards), config, progress)
    per_shard = [_read_stats(work / f"{i:05d}.stats.json") for i in range(len(shards))]
    stats = merge_run_stats(per_shard)
    stats.update(_finalize(work, output, len(shards), config, progress, executor))

    seconds = time.perf_counter() - start
    write_json(output / "stats.json", {
        "input": input_spec, "docs_in": stats[READ].docs_in, "docs_out": docs_out(stats),
        "seconds": round(seconds, 2), "stages": {n: s.to_dict() for n, s in stats.items()}})
    failpoint("clean-stats", 0, 0)
    shutil.rmtree(work)
    return CleanResult(stats, seconds, output)


@dataclass
class PartSignature:
    """What dedup needs of one worker part: its document count and lengths, exact keys
    and MinHash band keys (None when that dedup is off), and the seconds each took."""

    count: int
    chars: np.ndarray
    keys: np.ndarray | None
    bands: np.ndarray | None
    exact_seconds: float
    near_seconds: float


def part_signature(part: str, config: CleanConfig) -> PartSignature:
    docs = list(read_documents(part))
    dedup = config.dedup
    keys = bands = None
    t = time.perf_counter()
    if dedup and dedup.exact:
        keys = np.array([exact_key(d.text) for d in docs], np.uint64)
    exact_seconds, t = time.perf_counter() - t, time.perf_counter()
    if dedup and dedup.near:
        bands = MinHasher(dedup).band_keys(d.text for d in docs)
    return PartSignature(len(docs), np.array([len(d.text) for d in docs], np.int64), keys,
                         bands, exact_seconds, time.perf_counter() - t)


class Executor(ABC):
    """Where the work of a clean run happens: the per-shard pipeline, each part's dedup
    signature, and the two dedup resolutions (`index`: global document indices, ascending;
    each returns a mask over them)."""

    @abstractmethod
    def run_shards(self, pending: list, total: int, config: CleanConfig,
                   progress: bool) -> None: ...

    @abstractmethod
    def signatures(self, parts: list[Path], config: CleanConfig,
                   progress: bool) -> list[PartSignature]: ...

    @abstractmethod
    def first_occurrences(self, keys: np.ndarray, index: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def near_duplicate_mask(self, bands: np.ndarray, index: np.ndarray) -> np.ndarray: ...


class LocalExecutor(Executor):
    """Worker processes on this machine (`num_proc`), dedup resolved in this process."""

    def run_shards(self, pending: list, total: int, config: CleanConfig,
                   progress: bool) -> None:
        bar = progress_bar(total=total, initial=total - len(pending), unit="shard",
                           desc="clean", enabled=progress)
        docs, done, start = 0, total - len(pending), time.perf_counter()
        pool = None
        if config.num_proc <= 1:
            init_worker(config)
            results = map(clean_shard, pending)
        else:
            # spawn: workers must not inherit a parent's torch/tokenizer threads or locks.
            # A pool of futures, not multiprocessing.Pool: a worker killed (say by the OOM
            # killer) breaks it with an error, where Pool would wait for its task forever.
            pool = ProcessPoolExecutor(config.num_proc, multiprocessing.get_context("spawn"),
                                       initializer=init_worker, initargs=(config,))
            results = (f.result() for f in as_completed(
                [pool.submit(clean_shard, job) for job in pending]))
        try:
            for _, n in results:
                docs, done = docs + n, done + 1
                bar.set_postfix(docs_per_s=f"{docs / (time.perf_counter() - start):,.0f}")
                bar.update()
                failpoint("clean-shard", done, 0)
        except BrokenProcessPool:
            raise ConfigError("a cleaning worker process died (killed, or out of memory); the "
                              "shards it finished are kept — run the same command again to "
                              "resume, with a lower --num_proc if memory ran out") from None
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            bar.close()

    def signatures(self, parts: list[Path], config: CleanConfig,
                   progress: bool) -> list[PartSignature]:
        return [part_signature(str(p), config) for p in progress_bar(
            parts, desc="dedup", unit="shard", enabled=progress and config.dedup is not None)]

    def first_occurrences(self, keys: np.ndarray, index: np.ndarray) -> np.ndarray:
        return first_occurrences(keys, index)

    def near_duplicate_mask(self, bands: np.ndarray, index: np.ndarray) -> np.ndarray:
        return near_duplicate_mask(bands, index)


def _finalize(work: Path, output: Path, n_shards: int, config: CleanConfig,
              progress: bool, executor: Executor) -> RunStats:
    """Dedup across shards (if the recipe asks) and write the final parts, each step
    recorded so that a killed run resumes after the last one done."""
    suffix = SUFFIX[config.output_format]
    parts = [work / f"{i:05d}{suffix}" for i in range(n_shards)]
    decision, recorded = work / "keep.npy", work / "dedup.json"
    if not recorded.exists():
        keep, counts, stats = _dedup_decision(parts, config, progress, executor)
        with atomic_file(decision) as tmp, open(tmp, "wb") as f:
            np.save(f, keep)
        write_json(recorded, {"counts": counts,
                              "stages": {name: s.to_dict() for name, s in stats.items()}})
        failpoint("clean-dedup", 0, 0)
    keep = np.load(decision)
    record = json.loads(recorded.read_text())
    stats = {name: StageStats.from_dict(s) for name, s in record["stages"].items()}
    offsets = np.cumsum([0] + record["counts"])
    for i, part in enumerate(parts):
        final = output / f"part-{i:05d}{suffix}"
        if not part.exists():  # moved into place before the kill
            if not final.exists():
                raise ConfigError(f"{work}: {part.name} and {final.name} are both missing; "
                                  "the run cannot be resumed — delete the output folder")
            continue
        mask = keep[offsets[i]:offsets[i + 1]]
        if mask.all():  # nothing deduplicated away: the worker's file is already final
            os.replace(part, final)
        else:
            docs = [d for d, k in zip(read_documents(part), mask, strict=True) if k]
            write_documents(final, docs, config.output_format)
            part.unlink()
        failpoint("clean-part", i, 0)
    return stats


def _dedup_decision(parts: list[Path], config: CleanConfig, progress: bool,
                    executor: Executor) -> tuple[np.ndarray, list[int], RunStats]:
    """Which documents of all parts, in order, survive exact and near dedup, how many
    documents each part holds, and the dedup stages' statistics."""
    dedup = config.dedup
    signatures = executor.signatures(parts, config, progress)
    counts = [s.count for s in signatures]
    all_chars = np.concatenate([s.chars for s in signatures]) if signatures else \
        np.zeros(0, np.int64)
    keep = np.ones(len(all_chars), bool)
    stats: RunStats = {}
    if dedup and dedup.exact:
        t = time.perf_counter()
        index = np.arange(len(keep))
        exact = executor.first_occurrences(np.concatenate([s.keys for s in signatures]), index)
        seconds = sum(s.exact_seconds for s in signatures) + time.perf_counter() - t
        stats["exact_dedup"] = _dedup_stats(keep, exact, all_chars, "exact_duplicate", seconds)
        keep &= exact
    if dedup and dedup.near:
        t = time.perf_counter()
        survivors = np.flatnonzero(keep)
        near = np.zeros_like(keep)
        bands = np.concatenate([s.bands for s in signatures])
        near[survivors] = executor.near_duplicate_mask(bands[survivors], survivors)
        seconds = sum(s.near_seconds for s in signatures) + time.perf_counter() - t
        stats["near_dedup"] = _dedup_stats(keep, near | ~keep, all_chars, "near_duplicate",
                                           seconds)
        keep &= near
    return keep, counts, stats


def _dedup_stats(reaching: np.ndarray, kept: np.ndarray, chars: np.ndarray, reason: str,
                 seconds: float) -> StageStats:
    survive = reaching & kept
    s = StageStats(docs_in=int(reaching.sum()), kept=int(survive.sum()),
                   chars_in=int(chars[reaching].sum()), chars_out=int(chars[survive].sum()),
                   seconds=seconds)
    if s.docs_in - s.kept:
        s.dropped[reason] = s.docs_in - s.kept
    return s
