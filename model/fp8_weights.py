"""FP8 block-quantized checkpoints (transformers' `quant_method: "fp8"`, the format of
Qwen3's and DeepSeek-V3's official FP8 releases): each quantized weight is stored as
float8 beside a `weight_scale_inv` holding one float32 scale per block of
`weight_block_size` (128×128), its last blocks cut at the weight's edges. A load reads them
back to full precision, each weight times its block's scale, as transformers does where
there is no FP8 GPU — so lathe serves, fine-tunes and exports such a checkpoint (an export
is then full precision). Weights the checkpoint left unquantized (embeddings, norms,
often the LM head) are read as they are. The activations are not quantized: the config's
`activation_scheme: "dynamic"` describes vLLM's FP8 kernels, which round each token's
inputs to FP8 as they multiply; transformers' read-back leaves that out as well."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from lathe.core.errors import CheckpointError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(quantization: dict[str, Any], file: Path) -> tuple[int, int]:
    """The (rows, columns) of a scale's block, from config.json's `quantization_config`."""
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise CheckpointError(f"{file}: quantization_config.weight_block_size={block!r}: an "
                              "FP8 checkpoint gives the [rows, columns] of each scale's block "
                              "([128, 128] in Qwen3's and DeepSeek-V3's); lathe reads "
                              "block-scaled FP8 only")
    return block[0], block[1]


def dequantize_fp8(state: dict[str, torch.Tensor], block: tuple[int, int],
                   dtype: torch.dtype | None, where: Path) -> dict[str, torch.Tensor]:
    """`state` with each float8 weight times its block scales, in `dtype` (default: the
    checkpoint's unquantized weights' dtype) and its scale dropped; a float8 weight without
    a scale, a scale without a weight, or a scale that does not tile its weight, is a
    CheckpointError naming it. `state` is consumed: each float8 weight is let go as its
    full-precision one is made, so the load holds one copy of the model and a weight."""
    orphans = sorted(name for name in state if name.endswith(SCALE_SUFFIX)
                     and name.removesuffix(SCALE_SUFFIX) not in state)
    if orphans:
        raise CheckpointError(f"{where}: {orphans[0]} scales no weight (no "
                              f"{orphans[0].removesuffix(SCALE_SUFFIX)})")
    if dtype is None:
        dtype = next((t.dtype for name, t in state.items() if t.is_floating_point()
                      and t.dtype not in FP8_DTYPES and not name.endswith(SCALE_SUFFIX)),
                     torch.bfloat16)
    out: dict[str, torch.Tensor] = {}
    for name in [name for name in state if not name.endswith(SCALE_SUFFIX)]:
        tensor, scale = state.pop(name), state.get(name + SCALE_SUFFIX)
        if scale is None:
            if tensor.dtype in FP8_DTYPES:
                raise CheckpointError(f"{where}: {name} is {tensor.dtype} with no "
                                      f"{name}{SCALE_SUFFIX} to read it back by")
            out[name] = tensor
        else:
            out[name] = _dequantized(tensor, scale, block, f"{where}: {name}").to(dtype)
    return out


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                 where: str) -> torch.Tensor:
    """`weight` (..., rows, columns) times `scale` (..., ⌈rows/r⌉, ⌈columns/c⌉) spread over
    its blocks, in float32."""
    rows, columns = weight.shape[-2:]
    grid = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    if weight.dim() < 2 or tuple(scale.shape) != grid:
        raise CheckpointError(f"{where} {tuple(weight.shape)} has scales of shape "
                              f"{tuple(scale.shape)}; blocks of {list(block)} need {grid}")
    spread = scale.float().repeat_interleave(block[0], -2)[..., :rows, :] \
        .repeat_interleave(block[1], -1)[..., :columns]
    return weight.float() * spread
