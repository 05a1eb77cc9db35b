"""What a run reports: metrics to W&B (through accelerate's tracker) and to a local
`metrics.jsonl`, throughput as tokens/s and MFU, and memory.

MFU = achieved FLOP/s ÷ peak FLOP/s of all devices. Each step's FLOPs come from its stage
(`ModelConfig.flops_per_token` for each token it really computes); peak FLOP/s from a
table of dense bf16 tensor-core peaks per GPU (FP8 doubles them), or, on CPU, from a short
fp32 matmul measured at start-up.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lathe.core.atomic import atomic_file

# Dense (no sparsity) bf16 peak FLOP/s per device, by a substring of its CUDA name.
GPU_PEAK_BF16: dict[str, float] = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H800": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
    "T4": 65e12,
}


def peak_flops(device: torch.device, fp8: bool = False) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure came from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_BF16.items():
            if key in name:
                return flops * (2 if fp8 else 1), f"table: {key} {'fp8' if fp8 else 'bf16'}"
        return float("nan"), f"unknown GPU {name!r}: add it to GPU_PEAK_BF16"
    return measure_cpu_peak(), "measured: fp32 matmul"


def measure_cpu_peak() -> float:
    """Best fp32 matmul FLOP/s with this process's threads, measured once a process for each
    thread count: every stage started in one process reports MFU against the same peak."""
    return _matmul_peak(torch.get_num_threads())


@functools.cache
def _matmul_peak(threads: int, size: int = 1024, repeats: int = 5) -> float:
    """`threads`: the count torch runs on now, the cache's key. Its own generator: whether it
    ran leaves the run's random stream as it was."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak accelerator memory on CUDA, resident and peak resident host memory elsewhere (GiB)."""
    if device.type == "cuda":
        return {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    return {f"memory/{label}_gib": kib / 2**20 for label, kib in
            (("rss", _status_kib("VmRSS")), ("peak_rss", _status_kib("VmHWM")))
            if kib is not None}


class PeakMemory:
    """The most memory this rank held since `start`, comparable with a memory plan: on CUDA
    `max_memory_allocated` (tensors only), elsewhere the peak resident set minus the
    resident set at `start` (Linux: /proc/self/status, its peak reset through
    /proc/self/clear_refs). On CPU it counts every allocation, the allocator's retained
    pages among them; glibc returns freed large blocks to the system only below its mmap
    threshold, which it raises after each free unless MALLOC_MMAP_THRESHOLD_ is set."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = 0
            return
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
        self.base = (_status_kib("VmRSS") or 0) * 1024

    def resident(self) -> int:
        """Bytes held now above the start (CUDA: allocated)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return max((_status_kib("VmRSS") or 0) * 1024 - self.base, 0)

    def peak(self) -> int:
        """Bytes; 0 where nothing can tell."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return max((_status_kib("VmHWM") or 0) * 1024 - self.base, 0)


def _status_kib(key: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    for line in status.read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0])
    return None


class Throughput:
    """Tokens/s and MFU over the training time since the last `measure`; work outside
    training (rollout generation, evaluation) runs `paused()` and does not count."""

    def __init__(self, peak_flops_total: float) -> None:
        self.peak = peak_flops_total
        self.reset()

    def reset(self) -> None:
        self.start, self.tokens, self.flops, self.excluded = time.perf_counter(), 0, 0.0, 0.0

    def add(self, tokens: int, flops: float) -> None:
        self.tokens += tokens
        self.flops += flops

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - start

    def measure(self) -> dict[str, float]:
        seconds = max(time.perf_counter() - self.start - self.excluded, 1e-9)
        tokens_per_s, flops_per_s = self.tokens / seconds, self.flops / seconds
        self.reset()
        return {"tokens_per_s": tokens_per_s, "mfu": flops_per_s / self.peak}


def _step_of(line: str) -> float:
    """A record's step; infinite for a line torn by a kill mid-write, so it is dropped."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")


class MetricsLog:
    """Rank 0's record of a run: every logged dict appended to metrics.jsonl, and forwarded
    to accelerate's trackers (W&B) when any are configured."""

    def __init__(self, path: Path, accelerator: Any) -> None:
        self.path = path
        self.accelerator = accelerator

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (written by a run that died before its next checkpoint),
        so that a resumed run's metrics.jsonl reads as one uninterrupted run."""
        if not self.accelerator.is_main_process or not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if _step_of(line) <= step]
        with atomic_file(self.path) as tmp:
            tmp.write_text("".join(line + "\n" for line in kept))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.accelerator.is_main_process:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self.accelerator.log(scalars, step=step)

    def log_texts(self, name: str, rows: list[tuple[str, str]], step: int) -> None:
        """Prompt/continuation pairs: a W&B table, and one metrics.jsonl record."""
        if not self.accelerator.is_main_process:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, name: [list(r) for r in rows]}) + "\n")
        for tracker in self.accelerator.trackers:
            if tracker.name == "wandb":
                import wandb

                tracker.log({name: wandb.Table(columns=["prompt", "continuation"],
                                               data=[list(r) for r in rows])}, step=step)
