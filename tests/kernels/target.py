"""Where the kernel tests run. In CI: Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py) on CPU tensors, fp32 and fp16. On a GPU with `TRITON_INTERPRET=0`: the
same tests compiled on CUDA tensors, bf16 added (the interpreter's bf16 is wrong)."""

from __future__ import annotations

import os

import pytest
import torch

from lathe.kernels import dispatch

COMPILED = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if COMPILED else "cpu"
DTYPES = [torch.float32, torch.float16, pytest.param(
    torch.bfloat16, marks=pytest.mark.skipif(
        not COMPILED, reason="bf16 runs compiled on a GPU (TRITON_INTERPRET=0); the "
        "interpreter's bf16 is wrong"))]


def enable_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the dispatch pick Triton for every kernel (`LATHE_KERNELS=force`): on CPU onto
    the interpreter, on CUDA the ones the defaults table leaves off too. Compare with
    `lathe.kernels.dispatch.kernels_off`. tests/conftest.py restores the policy after."""
    monkeypatch.setenv("LATHE_KERNELS", "force")
    dispatch.configure()
