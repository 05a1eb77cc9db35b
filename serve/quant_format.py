"""A quantized checkpoint on disk, in compressed-tensors' format: the one llm-compressor
writes, vLLM and transformers load, and the hub's W4A16 / W8A16 / FP8-dynamic checkpoints
(Qwen3, Llama, Gemma, Mistral, their mixtures of experts) are in.

A checkpoint folder in this format is an ordinary HF checkpoint whose config.json carries
a `quantization_config` (quant_method "compressed-tensors", format "pack-quantized" or
"float-quantized") and whose quantized linears hold `weight_packed` (signed ints packed into
int32), `weight_scale` and `weight_shape`, and `weight_zero_point` when asymmetric, in place
of `weight` — or, for FP8, a float8 `weight` and its `weight_scale`; the head, embedding and
routers stay full precision, named in `ignore`.

lathe reads every scheme its quantized linears compute exactly: 4 bits in groups of 32, 64
or 128 columns or per output channel (its scale repeated for each group), symmetric or with
zero points, and 8 bits per output channel, symmetric (also the older `int-quantized`
format, int8 stored unpacked), weight-only; and FP8_DYNAMIC, float8 weights per channel (or
per tensor, its scale repeated for each row) with each token's inputs rounded to float8 as
it runs, as vLLM and transformers compute it. A 4-bit linear becomes an `Int4Linear`
(nibbles q + 8, scale, minimum = −(zero_point + 8) · scale), an 8-bit one an `Int8Linear`,
an FP8 one an `Fp8Linear`, through the same name mapping as a full checkpoint's weights (a
wrapper's language model, fused projections split, experts stacked). Anything else — integer
or static activation quantization, FP8 blocks, float types other than FP8,
activation-ordered groups (`g_idx`), other group sizes, mixed schemes — is refused, naming
the field. lathe writes int4 (asymmetric, `W4A16_ASYM`), int8 (`W8A16`) and FP8
(`FP8_DYNAMIC`) the same way, through compressed-tensors' own compressors and config."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lathe.core.atomic import atomic_directory
from lathe.core.checkpoint_files import (
    GENERATION_CONFIG_FILE,
    checkpoint_file,
    read_json_object,
)
from lathe.kernels.fp8_matmul import FP8
from lathe.model.checkpoint import (
    CONFIG_FILE,
    PROVENANCE_FILE,
    TOKENIZER_FILES,
    CheckpointError,
    hf_layout,
    lathe_layout,
    load_safetensors,
    weight_files,
)
from lathe.model.config import ModelConfig
from lathe.model.fp8_weights import ACTIVATION_SCALES
from lathe.serve.config import QuantMode

GROUP_SIZES = (32, 64, 128)  # what lathe's int4 kernels take (a K tile never crosses one)
FORMATS = ("pack-quantized", "int-quantized")
FP8_FORMAT = "float-quantized"
QUANTIZED_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                      "weight_g_idx")


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's weight quantization, as lathe's linears hold it."""
    mode: QuantMode
    group_size: int  # int4: input columns per scale; int8: 0 (one scale per output channel)
    symmetric: bool
    packed: bool  # pack-quantized (ints packed into int32), else int-quantized (int8)


def read_quant_scheme(path: str | Path) -> QuantScheme | None:
    """The weight quantization of a checkpoint folder's config.json, or None for a
    checkpoint loaded in full precision (a plain one, or an FP8 one read back to it); a
    scheme lathe cannot serve exactly is a CheckpointError naming the field, its value and
    what lathe serves instead."""
    file = checkpoint_file(path, CONFIG_FILE)
    quant = read_json_object(file).get("quantization_config")
    if quant is None or isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        return None

    def refuse(field: str, value: Any, why: str) -> CheckpointError:
        return CheckpointError(f"{file}: quantization_config.{field}={value!r}: {why}; lathe "
                               "serves compressed-tensors' W4A16 (in groups of 32/64/128), "
                               "W8A16 (per channel) and FP8_DYNAMIC checkpoints — for any "
                               "other, serve the full-precision checkpoint (with --quantize "
                               "int4|int8|fp8 to quantize it at load)")

    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise refuse("quant_method", method, "not compressed-tensors")
    from compressed_tensors.quantization import QuantizationScheme
    from pydantic import ValidationError
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse("config_groups", groups, "no quantization scheme")
    schemes = {}
    for name, group in groups.items():
        try:
            scheme = QuantizationScheme.model_validate(group)
        except ValidationError as error:
            first = error.errors()[0]
            raise refuse(f"config_groups.{name}", group,
                         f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        field = f"config_groups.{name}"
        weights = scheme.weights
        if weights is None:
            raise refuse(f"{field}.weights", None, "no weight quantization")
        if scheme.output_activations is not None:
            raise refuse(f"{field}.output_activations", group.get("output_activations"),
                         "outputs are quantized too")
        schemes[name] = _weight_scheme(weights, scheme.input_activations, quant.get("format"),
                                       group.get("format"),
                                       lambda key, value, why: refuse(f"{field}.{key}", value,
                                                                      why))
    # groups that differ in group size alone are one scheme: each linear's own is read
    # from its scales (lathe writes layers too narrow for the group size in groups of 32)
    kinds = {(scheme.mode, scheme.symmetric, scheme.packed) for scheme in schemes.values()}
    if len(kinds) > 1:
        raise refuse("config_groups", sorted(groups), "its groups quantize differently")
    return max(schemes.values(), key=lambda scheme: scheme.group_size)


def _value(field: Any) -> Any:
    """A compressed-tensors enum field's plain value."""
    return getattr(field, "value", field)


def _weight_scheme(weights: Any, activations: Any, model_format: Any, group_format: Any,
                   refuse) -> QuantScheme:
    fmt = group_format or model_format
    if _value(weights.type) == "float":
        return _fp8_scheme(weights, activations, fmt, refuse)
    if fmt not in FORMATS:
        raise refuse("format", fmt, f"not one of {', '.join(FORMATS)}")
    if _value(weights.type) != "int":
        raise refuse("weights.type", _value(weights.type), "not integer or float")
    if activations is not None:
        raise refuse("input_activations", activations.model_dump(exclude_defaults=True),
                     "integer activations are quantized too")
    if weights.dynamic:
        raise refuse("weights.dynamic", weights.dynamic, "scales computed at run time")
    strategy = _value(weights.strategy)
    if weights.num_bits == 4:
        if strategy == "channel":  # one scale a row: the same scale for each of its groups
            return QuantScheme("int4", 0, weights.symmetric, fmt == FORMATS[0])
        if strategy != "group" or weights.group_size not in GROUP_SIZES:
            raise refuse("weights.group_size", weights.group_size,
                         f"int4 must be per channel or in groups of "
                         f"{', '.join(map(str, GROUP_SIZES))}")
        return QuantScheme("int4", weights.group_size, weights.symmetric, fmt == FORMATS[0])
    if weights.num_bits == 8:
        if strategy != "channel" or not weights.symmetric:
            raise refuse("weights.strategy", strategy, "int8 must be symmetric, per channel")
        return QuantScheme("int8", 0, True, fmt == FORMATS[0])
    raise refuse("weights.num_bits", weights.num_bits, "not 4 or 8")


def _fp8_scheme(weights: Any, activations: Any, fmt: Any, refuse) -> QuantScheme:
    """FP8_DYNAMIC: float8 weights with a scale per row (or one for the tensor, which is
    the same scale for every row), each token's inputs rounded to float8 as it runs."""
    if fmt != FP8_FORMAT:
        raise refuse("format", fmt, f"float weights are {FP8_FORMAT}")
    if weights.num_bits != 8 or not weights.symmetric or weights.dynamic \
            or _value(weights.strategy) not in ("channel", "tensor"):
        raise refuse("weights", weights.model_dump(exclude_defaults=True),
                     "FP8 weights must be 8 bits, symmetric, static, per channel or tensor "
                     "(blocks are read back to full precision as quant_method fp8 only)")
    if activations is None or _value(activations.type) != "float" \
            or activations.num_bits != 8 or not activations.symmetric \
            or activations.dynamic is not True or _value(activations.strategy) != "token":
        raise refuse("input_activations",
                     activations and activations.model_dump(exclude_defaults=True),
                     "FP8 weights are served with each token's inputs rounded to float8 on "
                     "the fly (8 bits, symmetric, dynamic, strategy token)")
    return QuantScheme("fp8", 0, True, False)


def read_quantized_weights(path: Path, config: ModelConfig, scheme: QuantScheme,
                           device: torch.device) -> tuple[dict[str, Tensor], set[str]]:
    """A compressed-tensors checkpoint's weights as a `Transformer` quantized by
    `lathe.serve.quant.quantize_linears(..., only=names)` names and holds them: its state
    dict, and `names`, the modules (a linear, or a mixture of experts' `Experts`) that
    are quantized. An FP8 KV cache's scales (`kv_cache_scheme`) are dropped: the cache
    holds the activations' dtype, as vLLM's does unless told `--kv-cache-dtype fp8`."""
    raw: dict[str, Tensor] = {}
    for file in weight_files(path):
        raw.update({name: tensor for name, tensor in load_safetensors(file, device).items()
                    if not name.endswith(ACTIVATION_SCALES)})  # an FP8 KV cache's scales
    prefixes = sorted({name.removesuffix(".weight_scale") for name in raw
                       if name.endswith(".weight_scale")})
    values, scales, minimums = {}, {}, {}
    for prefix in prefixes:
        parts = {suffix: raw.pop(f"{prefix}.{suffix}") for suffix in QUANTIZED_SUFFIXES
                 if f"{prefix}.{suffix}" in raw}
        if not scheme.packed:
            parts["weight"] = raw.pop(f"{prefix}.weight", None)
        name = f"{prefix}.weight"
        values[name], scale, zero_point = _unpacked(prefix, parts, scheme, path)
        scales[name] = scale if scheme.mode == "int4" else scale.reshape(-1)
        if scheme.mode == "int4":
            minimums[name] = -(zero_point.float() + 8) * scale.float()
    # every quantized tensor moves by whole rows, so one mapping fits them all
    values, scales, minimums = (lathe_layout(tensors, config, per_row=True)
                                for tensors in (values, scales, minimums))
    state, quantized = lathe_layout(raw, config), set()
    for name, tensor in values.items():
        module = name.removesuffix(".weight")
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            module, kind = name.rsplit(".", 1)
            for expert in range(tensor.shape[0]):
                _put(state, f"{module}.{kind.removesuffix('_proj')}.{expert}",
                     tensor[expert], scales[name][expert],
                     minimums[name][expert] if minimums else None)
        else:
            _put(state, module, tensor, scales[name], minimums.get(name))
        quantized.add(module)
    return state, quantized


def _unpacked(prefix: str, parts: dict[str, Tensor], scheme: QuantScheme,
              path: Path) -> tuple[Tensor, Tensor, Tensor]:
    """One linear's weight as lathe holds it (int4: nibbles q + 8, (out, in / 2) bytes;
    int8: ints), its scales (out, groups) and its zero points (out, groups), from its
    stored tensors. compressed-tensors packs 4-bit values as lathe does — eight a word,
    the low nibble first, offset by 8 — so on a little-endian host an int4 weight is its
    packed words viewed as bytes, not unpacked: a 70B model loads in its int4 size."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from lathe.serve.quant import pack_nibbles
    if "weight_g_idx" in parts:
        raise CheckpointError(f"{path}: {prefix}.weight_g_idx: columns regrouped in "
                              "activation order, which lathe's kernels do not gather")
    if scheme.mode == "fp8":
        return _fp8_weight(prefix, parts, path)
    bits = 4 if scheme.mode == "int4" else 8
    scale = parts["weight_scale"]
    if scheme.packed:
        if "weight_packed" not in parts or "weight_shape" not in parts:
            raise CheckpointError(f"{path}: {prefix} has a weight_scale but no weight_packed "
                                  "and weight_shape beside it")
        packed, stored_shape = parts["weight_packed"], parts["weight_shape"].reshape(-1).tolist()
        shape = torch.Size(int(n) for n in stored_shape) if len(stored_shape) == 2 else None
        if (shape is None or packed.dtype != torch.int32 or packed.dim() != 2
                or packed.shape != (shape[0], -(-shape[1] * bits // 32))):
            raise CheckpointError(f"{path}: {prefix}.weight_packed {packed.dtype} "
                                  f"{tuple(packed.shape)} does not hold a weight of "
                                  f"weight_shape {stored_shape} at {bits} bits")
        out_features, in_features = shape
        if bits == 4 and in_features % 8 == 0 and sys.byteorder == "little":
            values = packed.view(torch.uint8)
        else:
            values = unpack_from_int32(packed, bits, shape)
    else:
        values = parts.get("weight")
        if values is None or values.dtype != torch.int8 or values.dim() != 2:
            raise CheckpointError(f"{path}: {prefix}.weight must be a 2-D int8 tensor beside "
                                  "its weight_scale (format int-quantized)")
        out_features, in_features = values.shape
    if bits == 4 and values.dtype == torch.int8:
        values = pack_nibbles((values + 8).to(torch.uint8))
    grouped = scheme.mode == "int4" and scheme.group_size > 0
    groups = scale.shape[-1] if grouped and scale.dim() == 2 else 1
    if grouped and (in_features % groups or in_features // groups not in GROUP_SIZES):
        raise CheckpointError(f"{path}: {prefix}.weight_scale has shape {tuple(scale.shape)}: "
                              f"groups of {in_features / groups:g} columns of its "
                              f"{in_features}; lathe's int4 kernels take groups of "
                              f"{', '.join(map(str, GROUP_SIZES))}")
    if not scale.is_floating_point() or scale.numel() != out_features * groups:
        raise CheckpointError(f"{path}: {prefix}.weight_scale has shape {tuple(scale.shape)}; "
                              f"a {out_features}×{in_features} weight in this scheme has "
                              f"{out_features}×{groups} scales")
    zero_point = torch.zeros(out_features, groups, dtype=torch.int8, device=values.device)
    if not scheme.symmetric:
        stored = parts.get("weight_zero_point")
        if stored is None:
            raise CheckpointError(f"{path}: {prefix}.weight_zero_point is missing (the "
                                  "scheme is asymmetric)")
        packed_rows = -(-out_features * bits // 32) if scheme.packed else out_features
        if stored.numel() != packed_rows * groups:
            raise CheckpointError(f"{path}: {prefix}.weight_zero_point has shape "
                                  f"{tuple(stored.shape)}; {out_features}×{groups} zero points "
                                  f"take {packed_rows}×{groups}")
        zero_point = unpack_from_int32(stored.reshape(packed_rows, groups), bits,
                                       torch.Size((out_features, groups)),
                                       packed_dim=0) if scheme.packed else stored
    scale, zero_point = scale.reshape(out_features, groups), zero_point.reshape(out_features,
                                                                                groups)
    if scheme.mode == "int4" and not grouped:  # a row's scale for each group of the row
        from lathe.serve.quant import int4_group_size
        width = in_features // int4_group_size(in_features, GROUP_SIZES[-1])
        scale = scale.expand(-1, width).contiguous()
        zero_point = zero_point.expand(-1, width).contiguous()
    return values, scale, zero_point


def _fp8_weight(prefix: str, parts: dict[str, Tensor],
                path: Path) -> tuple[Tensor, Tensor, Tensor]:
    """An FP8 linear's float8 weight, its (out, 1) float32 scales (a tensor's one scale
    repeated for each row) and no zero points."""
    weight, scale = parts.get("weight"), parts["weight_scale"]
    if weight is None or weight.dtype != FP8 or weight.dim() != 2:
        raise CheckpointError(f"{path}: {prefix}.weight must be a 2-D float8_e4m3fn tensor "
                              "beside its weight_scale (format float-quantized)")
    rows = weight.shape[0]
    if not scale.is_floating_point() or scale.numel() not in (1, rows):
        raise CheckpointError(f"{path}: {prefix}.weight_scale has shape {tuple(scale.shape)}; "
                              f"a weight of {rows} rows has one scale a row or one in all")
    scale = scale.float().reshape(-1, 1).expand(rows, 1).contiguous()
    return weight, scale, torch.zeros(rows, 1, dtype=torch.int8, device=weight.device)


def _put(state: dict[str, Tensor], module: str, values: Tensor, scale: Tensor,
         minimum: Tensor | None) -> None:
    """One quantized linear's buffers under `module`, as Int4Linear / Int8Linear hold them."""
    state[f"{module}.weight"], state[f"{module}.scale"] = values, scale
    if minimum is not None:
        state[f"{module}.minimum"] = minimum


def write_quantized_checkpoint(model: nn.Module, config: ModelConfig, source: Path, out: Path,
                               mode: QuantMode, group_size: int) -> Path:
    """`model`, quantized by `quantize_linears`, as a compressed-tensors checkpoint folder
    at `out` (atomically), with `source`'s tokenizer, generation config and provenance:
    each quantized linear compressed by compressed-tensors' pack-quantized (int) or
    float-quantized (FP8_DYNAMIC) compressor from its exact dequantized weight, so that the
    values written are the ones lathe holds."""
    from compressed_tensors.compressors import (
        FloatQuantizationCompressor,
        ModelCompressor,
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        preset_name_to_scheme,
    )
    from huggingface_hub import save_torch_state_dict

    from lathe.serve.quant import (
        WEIGHT_DTYPES,
        Fp8Linear,
        Int4Linear,
        Int8Linear,
        QuantizedExperts,
    )

    quantized = {name: module for name, module in model.named_modules()
                 if isinstance(module, (Int4Linear, Int8Linear, Fp8Linear, QuantizedExperts))}

    def inside(name: str) -> bool:  # a name within a quantized module
        return any(name.startswith(f"{module}.") for module in quantized)

    weights, scales, zero_points, dense = {}, {}, {}, {}
    for name, module in quantized.items():
        if isinstance(module, QuantizedExperts):
            for kind, linears in (("gate_up_proj", module.gate_up), ("down_proj", module.down)):
                parts = [_dequantized(linear) for linear in linears]
                key = f"{name}.{kind}"
                for target, index in ((weights, 0), (scales, 1), (zero_points, 2)):
                    target[key] = torch.stack([part[index] for part in parts])
        elif not inside(name):  # an expert's linear is written with its experts'
            key = f"{name}.weight"
            weights[key], scales[key], zero_points[key] = _dequantized(module)
            if module.bias is not None:
                dense[f"{name}.bias"] = module.bias
    dense.update({name: tensor for name, tensor in model.state_dict().items()
                  if not inside(name)})

    def scheme(targets: list[str], group: int) -> QuantizationScheme:
        if mode == "fp8":
            return preset_name_to_scheme("FP8_DYNAMIC", targets)
        return QuantizationScheme(targets=targets, weights=QuantizationArgs(
            num_bits=4 if mode == "int4" else 8, type="int", symmetric=mode == "int8",
            strategy="group" if mode == "int4" else "channel",
            group_size=group if mode == "int4" else None))

    hf_config = json.loads((source / CONFIG_FILE).read_text())
    hf_config.pop("quantization_config", None)
    # the full-precision rest in the source's dtype (a bf16 model's embedding and head stay
    # bf16); the scales stay float32, the ones the ints were rounded with
    stored = WEIGHT_DTYPES.get(str(hf_config.get("torch_dtype") or hf_config.get("dtype"))) \
        or torch.float32
    state = {name: tensor.to(stored) if tensor.is_floating_point() else tensor
             for name, tensor in hf_layout(dense, config).items()}
    # every full-precision matrix (and a Gated DeltaNet's convolution, a 3-D one) by name
    ignore = ["lm_head"] + sorted(name.removesuffix(".weight") for name, tensor in state.items()
                                  if tensor.dim() >= 2 and "embed_tokens" not in name
                                  and name != "lm_head.weight")
    hf_scales, hf_zero_points = hf_layout(scales, config), hf_layout(zero_points, config)
    compressor = FloatQuantizationCompressor if mode == "fp8" else PackedQuantizationCompressor
    narrow = []  # linears in groups of 32, too narrow for group_size
    for name, weight in hf_layout(weights, config).items():
        prefix = name.removesuffix(".weight")
        group = weight.shape[1] // hf_scales[name].shape[1] if mode == "int4" else group_size
        if group != group_size:
            narrow.append(prefix)
        parts = {"weight": weight, "weight_scale": hf_scales[name].contiguous()}
        if mode == "int4":
            parts["weight_zero_point"] = hf_zero_points[name].contiguous()
        state.update({f"{prefix}.{key}": tensor.contiguous() for key, tensor in
                      compressor.compress(parts, scheme([], group)).items()})
    groups = {"group_0": scheme(["Linear"], group_size)}
    if narrow:  # a module's own name outranks the class target
        groups["group_1"] = scheme(sorted(narrow), 32)
    quant_config = QuantizationConfig(config_groups=groups, ignore=ignore,
                                      format=FP8_FORMAT if mode == "fp8" else FORMATS[0],
                                      quantization_status="compressed")
    with atomic_directory(out) as tmp:
        save_torch_state_dict(state, tmp, max_shard_size="5GB", metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        ModelCompressor(quantization_config=quant_config).update_config(str(tmp))
        for name in (GENERATION_CONFIG_FILE, PROVENANCE_FILE, *TOKENIZER_FILES):
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
    return out


def _dequantized(linear: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
    """(its weight dequantized in float32, its scale, its zero point) of an Int4Linear,
    Int8Linear or Fp8Linear: the weight compressed-tensors quantizes back to exactly its
    ints or float8 values."""
    from lathe.kernels.quant_matmul import dequantize_int4, dequantize_int8
    if linear.weight.dtype == FP8:
        scale = linear.scale.float()[:, None]
        return linear.weight.float() * scale, scale, torch.zeros_like(scale)
    if hasattr(linear, "minimum"):
        scale = linear.scale.float()
        zero_point = torch.round(-linear.minimum.float() / scale) - 8
        return (dequantize_int4(linear.weight, linear.scale, linear.minimum), scale,
                zero_point.to(torch.int8))
    scale = linear.scale.float()
    return dequantize_int8(linear.weight, scale), scale[:, None], torch.zeros_like(scale)
