"""Host memory for serving on the CPU: weights held in huge pages, and freed memory kept
mapped, so that an engine's per-step temporaries stop faulting their pages in every step.

A decode step reads every weight once, so each 4 KiB page costs a TLB miss a token, and in a
virtual machine (two-level page tables) a miss is a long walk: the native linears of the 88M
model streamed bf16 weights at 31 GB/s from 4 KiB pages and 60 GB/s from 2 MiB ones (a
decode step's linears 5.8 → 4.2 ms). `hold_in_huge_pages` copies a model's tensors into one
mapping that asks the kernel for transparent huge pages (`MADV_HUGEPAGE`, which Linux's
default `madvise` mode honours); elsewhere the advice is a no-op and the copy only packs them.

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

import torch
from torch import nn

# glibc's malloc.h
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30

_retained = False

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's mman.h
_ALIGN = 64  # each tensor's start: a cache line, and what torch's CPU GEMMs need


@torch.no_grad()
def hold_in_huge_pages(model: nn.Module) -> int:
    """Copy every CPU parameter and buffer of `model` into one block of memory advised to
    be backed by huge pages, in place (tied tensors stay tied; the copies also drop any view
    of a memory-mapped checkpoint file); returns the bytes moved."""
    tensors: dict[tuple, list[torch.Tensor]] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "cpu" and tensor.numel():
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            tensors.setdefault(key, []).append(tensor)
    sizes = [-(-group[0].numel() * group[0].element_size() // _ALIGN) * _ALIGN
             for group in tensors.values()]
    total = sum(sizes)
    if not total:
        return 0
    block = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)
    start = -block.data_ptr() % HUGE_PAGE
    if sys.platform.startswith("linux"):  # before the copies touch (and so allocate) pages
        ctypes.CDLL(None).madvise(ctypes.c_void_p(block.data_ptr() + start),
                                  ctypes.c_size_t(-(-total // HUGE_PAGE) * HUGE_PAGE),
                                  _MADV_HUGEPAGE)
    offset = start
    for group, size in zip(tensors.values(), sizes, strict=True):
        first = group[0]
        packed = block[offset:offset + first.numel() * first.element_size()]
        packed = packed.view(first.dtype).view(first.shape)
        packed.copy_(first)
        for tensor in group:
            tensor.data = packed
        offset += size
    return total


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
