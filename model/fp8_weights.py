"""FP8 checkpoints read back to full precision, for training, merging and exporting (and
for serving the block-scaled ones). Two formats:

- transformers' `quant_method: "fp8"` (Qwen3's and DeepSeek-V3's official FP8 releases):
  each quantized weight is stored as float8 beside a `weight_scale_inv` holding one float32
  scale per block of `weight_block_size` (128×128), its last blocks cut at the weight's edges;
- compressed-tensors' `float-quantized` (llm-compressor's FP8_DYNAMIC, FP8 and FP8_BLOCK: the
  hub's `*-FP8-dynamic` checkpoints): a float8 `weight` beside a `weight_scale` per row, per
  tensor, or per block of the scheme's `block_structure`; the activation scales some schemes
  store (`input_scale`) belong to the serving computation, not the weights, and are dropped.

Each weight is read back as its float8 values times its block's (row's, tensor's) scale, as
transformers does where there is no FP8 GPU (`run_compressed=False` for compressed-tensors).
Weights the checkpoint left unquantized (embeddings, norms, often the LM head) are read as
they are. An export is then full precision. The activations are not quantized here: the
block-scaled checkpoints' `activation_scheme: "dynamic"` describes vLLM's FP8 kernels, which
round each token's inputs to FP8 as they multiply, and transformers' read-back leaves that
out as well; `lathe serve` runs FP8_DYNAMIC as it is meant (`lathe.serve.quant_format`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lathe.core.errors import CheckpointError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# compressed-tensors' scales of activations and of the KV cache: not weights
ACTIVATION_SCALES = (".input_scale", ".output_scale", ".k_scale", ".v_scale")


@dataclass(frozen=True)
class Fp8Format:
    """How a checkpoint stores its float8 weights' scales: beside `name`, at `name +
    suffix`, one per block of `block` (rows, columns), or with `block` None one per row or
    one for the whole weight."""
    suffix: str
    block: tuple[int, int] | None


def fp8_format(quantization: Any, file: Path) -> Fp8Format | None:
    """The FP8 format config.json's `quantization_config` describes, or None when it
    describes none (no quantization, or another kind, which the caller refuses)."""
    if not isinstance(quantization, dict):
        return None
    if quantization.get("quant_method") == "fp8":
        block = quantization.get("weight_block_size")
        if not _is_block(block):
            raise CheckpointError(f"{file}: quantization_config.weight_block_size={block!r}: "
                                  "an FP8 checkpoint gives the [rows, columns] of each scale's "
                                  "block ([128, 128] in Qwen3's and DeepSeek-V3's); lathe "
                                  "reads block-scaled FP8 only")
        return Fp8Format("_scale_inv", (block[0], block[1]))
    groups = quantization.get("config_groups")
    if quantization.get("quant_method") != "compressed-tensors" or not isinstance(groups, dict) \
            or not groups or not all(_float8_weights(group) for group in groups.values()):
        return None
    blocks = {json.dumps(group["weights"].get("block_structure")) for group in groups.values()}
    block = json.loads(blocks.pop()) if len(blocks) == 1 else blocks
    if block is not None and not _is_block(block):
        raise CheckpointError(f"{file}: quantization_config.config_groups: weights."
                              f"block_structure {block!r}: lathe reads one [rows, columns] "
                              "block for every group, or scales per row or tensor")
    return Fp8Format("_scale", None if block is None else (block[0], block[1]))


def _is_block(block: Any) -> bool:
    return isinstance(block, list) and len(block) == 2 and all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)


def _float8_weights(group: Any) -> bool:
    """Whether a compressed-tensors config group's weights are float8 (its `format`, or the
    checkpoint's, is then `float-quantized`)."""
    weights = group.get("weights") if isinstance(group, dict) else None
    return isinstance(weights, dict) and weights.get("type") == "float" \
        and weights.get("num_bits") == 8


def dequantize_fp8(state: dict[str, torch.Tensor], form: Fp8Format,
                   dtype: torch.dtype | None, where: Path) -> dict[str, torch.Tensor]:
    """`state` with each float8 weight times its scales, in `dtype` (default: the
    checkpoint's unquantized weights' dtype) and its scale dropped (and any activation
    scales); a float8 weight without a scale, a scale without a weight, or a scale that does
    not tile its weight, is a CheckpointError naming it. `state` is consumed: each float8
    weight is let go as its full-precision one is made, so the load holds one copy of the
    model and a weight."""
    suffix = form.suffix
    for name in [name for name in state if name.endswith(ACTIVATION_SCALES)]:
        del state[name]
    orphans = sorted(name for name in state if name.endswith(suffix)
                     and name.removesuffix(suffix) not in state)
    if orphans:
        raise CheckpointError(f"{where}: {orphans[0]} scales no weight (no "
                              f"{orphans[0].removesuffix(suffix)})")
    if dtype is None:
        dtype = next((t.dtype for name, t in state.items() if t.is_floating_point()
                      and t.dtype not in FP8_DTYPES and not name.endswith(suffix)),
                     torch.bfloat16)
    out: dict[str, torch.Tensor] = {}
    for name in [name for name in state if not name.endswith(suffix)]:
        tensor, scale = state.pop(name), state.get(name + suffix)
        if scale is None:
            if tensor.dtype in FP8_DTYPES:
                raise CheckpointError(f"{where}: {name} is {tensor.dtype} with no "
                                      f"{name}{suffix} to read it back by")
            out[name] = tensor
        else:
            out[name] = _dequantized(tensor, scale, form.block, f"{where}: {name}").to(dtype)
    return out


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                 where: str) -> torch.Tensor:
    """`weight` (..., rows, columns) times `scale` (..., ⌈rows/r⌉, ⌈columns/c⌉) spread over
    its blocks, in float32; with `block` None, `scale` is one per row or one in all."""
    rows, columns = weight.shape[-2:] if weight.dim() >= 2 else (0, 0)
    if block is None:
        block = (rows if scale.numel() == 1 else 1, columns)
        if scale.numel() == 1:
            scale = scale.reshape(*weight.shape[:-2], 1, 1)
    grid = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    if weight.dim() < 2 or tuple(scale.shape) != grid:
        raise CheckpointError(f"{where} {tuple(weight.shape)} has scales of shape "
                              f"{tuple(scale.shape)}; blocks of {list(block)} need {grid}")
    spread = scale.float().repeat_interleave(block[0], -2)[..., :rows, :] \
        .repeat_interleave(block[1], -1)[..., :columns]
    return weight.float() * spread
