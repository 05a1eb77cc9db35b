"""lathe's mixed-precision policy — the one place it is written down.

- Training keeps weights, gradients and optimizer states in fp32. The launch's
  `mixed_precision` (bf16 by default on CUDA, "no" = fp32 on CPU, where bf16 matmuls are
  ~100× slower) is applied by accelerate's autocast around the policy's forward.
- Every other forward a stage runs takes the same autocast (`Runtime.autocast`): validation,
  sample continuations, task accuracy through the serve engine, the DPO/GRPO reference, the
  distillation teacher, GRPO rollouts. So a reference's log-probs are computed in the
  numerics of the policy they are compared with (DPO's step-0 loss is log 2 on GPU too).
- Activations, and so K/V, have the autocast dtype: `compute_dtype`. KV caches made during
  training are allocated in it; a cache always stores and attends in its own dtype, and the
  attention ops refuse q/k/v of different dtypes on every device (Triton's `tl.dot` would
  on GPU), so a mismatch fails in a CPU test rather than on the first GPU run.
- FP8 (torchao) replaces eligible linears' matmuls inside that autocast; `torch._scaled_mm`
  needs every GEMM dimension divisible by 16, which `lathe.pretrain.runtime.converters` guarantees.
- Exports are bf16 when the run was bf16, else fp32; serving runs in the checkpoint's dtype.
"""

from __future__ import annotations

import os

import torch

_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_mixed_precision() -> str:
    """The launch config's choice, else bf16 on CUDA and fp32 elsewhere (bf16 matmuls on
    CPUs without AMX run ~100x slower than fp32 ones)."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION") or (
        "bf16" if torch.cuda.is_available() else "no")


def compute_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype activations and KV caches have under accelerate's `mixed_precision`
    ("no", "bf16", "fp16"; "fp8" computes the rest in bf16)."""
    return _DTYPES.get(mixed_precision, torch.bfloat16)
