"""Keeping freed host memory mapped, so that an engine's per-step temporaries on CPU stop
faulting their pages in again every step.

glibc's malloc hands an allocation above its mmap threshold (128 KiB, raised as such
blocks are freed) a fresh mapping and unmaps it when freed, and returns the top of its
heap to the OS once more than the trim threshold is free. A prefill's activations (a
512 × 352 float32 tensor is 720 KiB) are allocated and freed every step, so each step
zero-fills and faults them in again: ~8,000 page faults in one offline run of the README
model, ~10% of its time. Allocators made for this (jemalloc, tcmalloc: what PyTorch's and
vLLM's CPU guides preload) keep such memory; `retain_freed_memory` has glibc do the same:
allocations up to its largest mmap threshold (32 MiB) come from the heap, and up to 1 GiB
of freed heap stays mapped for the next step. It is process-wide, set once, and does
nothing on a libc without `mallopt` (musl, macOS) or when another allocator is preloaded
(glibc's settings then govern nothing).
"""

from __future__ import annotations

import ctypes
import sys

# glibc's malloc.h
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30

_retained = False


def retain_freed_memory() -> bool:
    """Have glibc keep freed memory mapped (see the module docstring); whether it took."""
    global _retained
    if _retained or not sys.platform.startswith("linux"):
        return _retained
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc
        return False
    _retained = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                     and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _retained
