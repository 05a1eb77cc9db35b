"""LoRA adapters on the shared `Transformer`, through `peft`.

Adapters are injected into the model in place (`peft.inject_adapter_in_model`), so the
module stays a `Transformer` — the training runtime's converters, the serving engine
and every loss see the same class — with its base weights frozen. Because lathe's
parameter names are Hugging Face Llama's, `save_adapter` writes an ordinary peft
adapter folder (`adapter_config.json`, `adapter_model.safetensors`) that
`PeftModel.from_pretrained(LlamaForCausalLM...)` loads, and `load_adapter` reads one back.
`merge_lora` folds the adapters into the base weights and removes them.

A mixture of experts' stacked experts are parameters, not linears: targeting gate_proj,
up_proj or down_proj adapts them through peft's `target_parameters` (`experts.gate_up_proj`,
whole, for either of the first two; `experts.down_proj`; a rank-r update per expert), as it
adapts transformers' own MoE classes, so such an adapter loads in peft on the original class
too. On a mixture of experts those names mean the experts only, not a dense layer's MLP or a
shared expert: peft on transformers 5 reads them so (it rewrites them into the experts'
parameters, for adapters trained on transformers 4), and an adapter that also held the
dense linears would not load as trained. The engine's adapter slots serve linear adapters
only; an expert adapter is served merged.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from lathe.core.atomic import atomic_directory
from lathe.core.errors import ConfigError
from lathe.core.reporting import quiet_loggers
from lathe.model.config import ModelConfig
from lathe.model.families import FAMILIES, FUSED, adapter_renamed, fused_rows
from lathe.model.transformer import Transformer


def _peft() -> types.ModuleType:
    """peft, imported on first use (a run without LoRA never loads it) and quietly: it
    imports torchao, whose missing-CUDA-extension and pytree-deprecation lines concern
    FP8 kernels a LoRA run does not use."""
    with quiet_loggers("torchao", "torch.utils._pytree"):
        import peft
        import peft.tuners.lora
        import peft.tuners.tuners_utils
        import peft.utils
    return peft


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # how PeftModel names a wrapped model's parameters
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Qwen3.5's Gated DeltaNet layers' linears (transformers' names), which targets may add
DELTA_NET_LINEARS = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
# a stacked expert parameter -> the MLP targets that reach it
EXPERT_PARAMETERS = {"experts.gate_up_proj": ("gate_proj", "up_proj"),
                     "experts.down_proj": ("down_proj",)}


@dataclass
class LoraSection:
    """`enabled: true` trains rank-`r` adapters on `target_modules` and freezes the rest."""

    enabled: bool = False
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(ALL_LINEARS))
    qlora: bool = False  # NF4 4-bit frozen base (bitsandbytes; CUDA only)

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ConfigError(f"lora.r={self.r} must be >= 1")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
        unknown = sorted(set(self.target_modules) - set(ALL_LINEARS) - set(DELTA_NET_LINEARS)
                         - {"lm_head"})
        if unknown or not self.target_modules:
            raise ConfigError(f"lora.target_modules={self.target_modules}: choose from "
                              f"{', '.join(ALL_LINEARS)} (and lm_head; a Qwen3.5 model's "
                              f"linear-attention layers: {', '.join(DELTA_NET_LINEARS)})")

    @property
    def scale(self) -> float:
        """What peft multiplies B·A by (alpha / r)."""
        return self.alpha / self.r

    def peft_config(self, experts: bool = False) -> Any:
        """The `peft.LoraConfig` of this section; `experts`: the model is a mixture of
        experts, whose stacked experts — and only they — the MLP targets reach, as
        parameters."""
        mlp = {part for parts in EXPERT_PARAMETERS.values() for part in parts}
        modules = [t for t in self.target_modules if not (experts and t in mlp)]
        return self.lora_config(modules, self.expert_parameters() if experts else None)

    def lora_config(self, modules: list[str], parameters: list[str] | None) -> Any:
        """The `peft.LoraConfig` of this section's rank, scale and dropout on `modules`
        (linears, by name) and `parameters` (stacked experts; None: none)."""
        return _peft().LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                                  target_modules=modules, target_parameters=parameters,
                                  bias="none", task_type="CAUSAL_LM")

    def expert_parameters(self) -> list[str]:
        """The stacked expert parameters the MLP targets reach (peft `target_parameters`)."""
        wanted = set(self.target_modules)
        return [name for name, parts in EXPERT_PARAMETERS.items() if wanted & set(parts)]


def apply_lora(model: Transformer, section: LoraSection) -> Transformer:
    """Inject adapters in place and freeze every base parameter (QLoRA: first store the
    targeted base linears in 4-bit NF4)."""
    if section.qlora:
        quantize_base_4bit(model, section.target_modules)
    return _inject(model, section.peft_config(has_experts(model)),
                   bool(section.dropout or section.qlora))


def _inject(model: Transformer, config: Any, inexact_head: bool) -> Transformer:
    """Inject `config`'s adapters; `inexact_head`: dropout or a quantized base, under which
    the chunked head's base + B·A (`Transformer.head_weight`) is not the adapted head."""
    _peft().inject_adapter_in_model(config, model)
    if "lm_head" in config.target_modules and inexact_head:
        model.chunked_head = False
    return model


def quantize_base_4bit(model: Transformer, targets: list[str]) -> None:
    """Swap the targeted linears for bitsandbytes NF4 layers on the GPU (QLoRA's base).
    The weights must be real (loaded), not on the meta device: NF4 quantizes values."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("quantize_base_4bit needs loaded weights, not meta tensors; a "
                         "gathered full-precision copy takes plain LoRA (merge_lora)")
    if not torch.cuda.is_available():
        raise ConfigError("lora.qlora=true needs a CUDA GPU (bitsandbytes 4-bit kernels); "
                          "none is visible here, so train plain LoRA with lora.qlora=false")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError("lora.qlora=true needs bitsandbytes: pip install bitsandbytes") from None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name in targets:
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                          compute_dtype=torch.bfloat16, quant_type="nf4")
                layer.weight = bnb.nn.Params4bit(child.weight.data.cpu(), requires_grad=False,
                                                 quant_type="nf4")
                setattr(parent, name, layer)
    model.cuda()  # bitsandbytes quantizes on the move to the GPU


def has_experts(model: nn.Module) -> bool:
    """Whether `model` is a lathe mixture of experts (its stacked experts take adapters)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "n_experts", None))


def expert_adapters(names: Any) -> list[str]:
    """The adapter weights among `names` that adapt stacked experts."""
    return sorted(name for name in names if ".mlp.experts." in f"{name}.")


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """The adapter-wrapped layers (peft `BaseTunerLayer`s) of `model`."""
    if "peft" not in sys.modules:  # nothing can carry adapters before peft is imported
        return []
    base = _peft().tuners.tuners_utils.BaseTunerLayer
    return [m for m in model.modules() if isinstance(m, base)]


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model's forward, adapters bypassed (DPO's reference without a copy)."""
    layers = lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def save_adapter(model: nn.Module, section: LoraSection, path: str | Path,
                 base_model: str | Path) -> Path:
    """Write a peft adapter folder (atomically) that names its base checkpoint (as an
    absolute path), so `AutoPeftModelForCausalLM.from_pretrained(path)` loads it. For a
    family that stores projections fused (Phi-3), the adapter is written on the fused
    modules its class has (`fuse_adapter`)."""
    state = {name: tensor.detach().contiguous().cpu()
             for name, tensor in _peft().utils.get_peft_model_state_dict(model).items()}
    config = section.peft_config(has_experts(model))
    if isinstance(model, Transformer) and FAMILIES[model.config.family].fused:
        state, config.r, config.target_modules = fuse_adapter(state, section.r, model.config,
                                                              output_widths(model))
        config.lora_alpha = section.alpha * config.r / section.r
    if isinstance(model, Transformer):
        state = adapter_renamed(state, model.config, to_checkpoint=True)
    state = {PEFT_PREFIX + name: tensor for name, tensor in state.items()}
    config.base_model_name_or_path = str(Path(base_model).resolve())
    with atomic_directory(path) as tmp:
        config.save_pretrained(str(tmp))
        save_file(state, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return Path(path)


def load_adapter(model: Transformer, path: str | Path) -> Transformer:
    """Inject a saved adapter folder's LoRA layers and weights into `model`."""
    path = Path(path)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"{path} is not a LoRA adapter folder (needs {ADAPTER_CONFIG} and "
                          f"{ADAPTER_WEIGHTS}, as written by a lathe LoRA run)")
    raw = json.loads((path / ADAPTER_CONFIG).read_text())
    modules = {part.rpartition(".")[2] for target in raw["target_modules"]
               for part in FUSED.get(_fused_name(target), [target])}
    parameters = [p for p in raw.get("target_parameters") or () if p in EXPERT_PARAMETERS]
    section = LoraSection(enabled=True, r=raw["r"], alpha=raw["lora_alpha"],
                          dropout=raw.get("lora_dropout", 0.0), target_modules=sorted(
                              modules | {part for p in parameters
                                         for part in EXPERT_PARAMETERS[p]}))
    # the adapter's own targets, as peft reads them on its class: its modules are linears
    # by name (on Gemma 4's or Qwen2-MoE's class, gate_proj is the MLP beside the experts,
    # lathe's shared expert), its parameters the stacked experts
    _inject(model, section.lora_config(sorted(modules), parameters or None),
            section.dropout > 0)
    pairs = split_fused_pairs(adapter_pairs(adapter_renamed(
        {name.removeprefix(PEFT_PREFIX): tensor
         for name, tensor in load_file(path / ADAPTER_WEIGHTS).items()}, model.config)),
        output_widths(model), model.config)
    state = {f"{module}.lora_{half}.weight": tensor for module, (a, b) in pairs.items()
             for half, tensor in (("A", a), ("B", b))}
    result = _peft().utils.set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise ConfigError(f"{path}: adapter weights {result.unexpected_keys[:4]} match no "
                          "layer of this model; was it trained on a different base?")
    return model


def adapter_weights(model: nn.Module) -> dict[str, Tensor]:
    """A copy of the LoRA weights of a model with adapters, under its module names."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()
            if ".lora_" in name}


def adapter_pairs(weights: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """LoRA weights under peft's names (`<module>.lora_A.default.weight`, ...) as module
    name -> (A, B), the form a serving engine's adapter slots take."""
    pairs: dict[str, dict[str, Tensor]] = {}
    for name, tensor in weights.items():
        module, _, rest = name.partition(".lora_")
        pairs.setdefault(module, {})[rest[0]] = tensor
    missing = sorted(module for module, pair in pairs.items() if set(pair) != {"A", "B"})
    if missing:
        raise ValueError(f"LoRA weights of {missing[:4]} lack their A or B half")
    return {module: (pair["A"], pair["B"]) for module, pair in pairs.items()}


def output_widths(model: nn.Module) -> dict[str, int]:
    """Each linear's (or adapter-wrapped linear's) output width, by module name."""
    return {name: module.out_features for name, module in model.named_modules()
            if isinstance(getattr(module, "out_features", None), int)}


def _fused_name(module: str) -> str | None:
    """The `FUSED` key a module name (or a bare target like "qkv_proj") ends with."""
    return next((f for f in FUSED if module == f.rpartition(".")[2] or module.endswith(f)),
                None)


def split_fused_pairs(pairs: dict[str, tuple[Tensor, Tensor]], widths: dict[str, int],
                      config: ModelConfig) -> dict[str, tuple[Tensor, Tensor]]:
    """An adapter on fused projections (Phi-3's `qkv_proj`, `gate_up_proj`, Qwen3-Next's
    `in_proj_qkvz`, `in_proj_ba`) as adapters on the projections they stack: each part keeps
    A and takes its rows of B, which is exactly the fused B·A's rows. `widths`: a module
    name -> its output width; `config`: the base's (where the parts' rows interleave)."""
    out = {}
    for module, (a, b) in pairs.items():
        fused = _fused_name(module)
        if fused is None:
            out[module] = (a, b)
            continue
        parts = [module.replace(fused, part) for part in FUSED[fused]]
        rows = [widths.get(part, 0) for part in parts]
        if sum(rows) != b.shape[0] or not all(rows):
            raise ValueError(f"LoRA B of {module} has {b.shape[0]} rows, but this model's "
                             f"{', '.join(parts)} give {rows}")
        order = fused_rows(config, fused)
        if order is not None:
            b = b[order]
        out.update({part: (a, piece) for part, piece in zip(parts, b.split(rows), strict=True)})
    return out


def fuse_adapter(state: dict[str, Tensor], rank: int, config: ModelConfig,
                 widths: dict[str, int]) -> tuple[dict[str, Tensor], int, list[str]]:
    """Adapters on lathe's split projections as one peft adapter on the fused ones of
    `config`'s family (Phi-3's `qkv_proj`, `gate_up_proj`; Qwen3-Next's, rows interleaved):
    a fused module's A stacks its parts' A's and its B puts each part's B in its own rows
    and columns (block-diagonal), so B·A is each part's own update, exactly; an untargeted
    part is zeros. peft takes one rank per adapter, so every module is padded with zeros to
    the widest stack's rank (the caller scales alpha by the same factor, keeping alpha / r;
    no stack, no padding). Returns the weights, that rank and the targets. `widths`: a module
    name -> its output width."""
    fused = FAMILIES[config.family].fused
    out: dict[str, tuple[Tensor, Tensor]] = {}
    # a fused module's name -> (its FUSED key, the adapters of its parts present)
    stacks: dict[str, tuple[str, dict[str, tuple[Tensor, Tensor]]]] = {}
    for module, (a, b) in adapter_pairs(state).items():
        match = next(((f, part) for f in fused for part in FUSED[f] if module.endswith(part)),
                     None)
        if match is None:
            out[module] = (a, b)
        else:
            name, part = match
            stacks.setdefault(module.removesuffix(part) + name, (name, {}))[1][part] = (a, b)
    wide = rank * max((len(FUSED[name]) for name, _ in stacks.values()), default=1)
    for target, (fused_name, parts) in stacks.items():
        prefix = target.removesuffix(fused_name)
        a0 = next(iter(parts.values()))[0]
        a_rows, b_rows = [], []
        for index, part in enumerate(FUSED[fused_name]):
            a, b = parts.get(part, (a0.new_zeros(rank, a0.shape[1]),
                                    a0.new_zeros(widths[prefix + part], rank)))
            block = b.new_zeros(b.shape[0], len(FUSED[fused_name]) * rank)
            block[:, index * rank:(index + 1) * rank] = b
            a_rows.append(a)
            b_rows.append(block)
        rows = fused_rows(config, fused_name)
        b = torch.cat(b_rows)
        out[target] = (torch.cat(a_rows), b if rows is None else b[torch.argsort(rows)])
    state = {}
    experts = set(expert_adapters(out))
    for module, (a, b) in out.items():
        # peft's stacked experts hold A (experts · r, in) and B (out, r · experts): each
        # expert's ranks are padded, as a linear's (or a stack's) are
        groups = a.shape[0] // rank if module in experts else 1
        width = a.shape[0] // groups
        state[f"{module}.lora_A.weight"] = F.pad(
            a.view(groups, width, -1), (0, 0, 0, wide - width)).reshape(groups * wide, -1)
        state[f"{module}.lora_B.weight"] = F.pad(
            b.view(b.shape[0], width, groups), (0, 0, 0, wide - width)).reshape(b.shape[0], -1)
    return state, wide, sorted({module.rpartition(".")[2] for module in out
                                if module not in experts})  # those are target_parameters


class AdapterMerger:
    """Full-precision base weights plus a policy's current adapter weights -> the merged
    full state dict a serving engine loads (peft's `get_delta_weight`; the base is never
    modified, so repeated merges do not drift). Under QLoRA this is how the rollout engine
    gets bf16/fp32 weights: the policy's own base is 4-bit."""

    def __init__(self, base: Transformer, section: LoraSection) -> None:
        self.section = dataclasses.replace(section, qlora=False)
        self.model = apply_lora(copy.deepcopy(base), self.section)
        self.model.requires_grad_(False)

    @torch.no_grad()
    def write_adapter(self, adapters: dict[str, Tensor], path: str | Path,
                      base_model: str | Path) -> Path:
        """The policy's current `adapters` as a peft adapter folder at `path` (what a
        server loads in place of merged weights: a LoRA run pushes its adapters alone)."""
        self._load(adapters)
        return save_adapter(self.model, self.section, path, base_model)

    def _load(self, adapters: dict[str, Tensor]) -> None:
        expected = set(adapter_weights(self.model))
        if set(adapters) != expected:
            raise ValueError(f"adapter weights do not match the base's LoRA layers: missing "
                             f"{sorted(expected - set(adapters))[:4]}, unexpected "
                             f"{sorted(set(adapters) - expected)[:4]}")
        self.model.load_state_dict(adapters, strict=False)

    @torch.no_grad()
    def __call__(self, adapters: dict[str, Tensor]) -> dict[str, Tensor]:
        self._load(adapters)
        merged = {}
        for name, layer in self.model.named_modules():
            if not isinstance(layer, _peft().tuners.lora.LoraLayer):
                continue
            delta = layer.get_delta_weight(layer.active_adapters[0])
            parameter = getattr(layer, "parameter_name", None)  # a stacked expert parameter
            if parameter is None:
                merged[f"{name}.weight"] = layer.get_base_layer().weight + delta
            else:
                module = name.replace(".base_layer", "")
                merged[f"{module}.{parameter}"] = \
                    getattr(layer.get_base_layer(), parameter) + delta
        state = {}
        for name, tensor in self.model.state_dict().items():
            if ".lora_" not in name:
                name = re.sub(r"(\.base_layer)+\.", ".", name)  # wrappers may nest
                state[name] = merged.get(name, tensor)
        return state


@torch.no_grad()
def merge_lora(model: Transformer) -> Transformer:
    """Fold every adapter into its base weight and put the plain module back (a wrapper
    around a wrapper — two adapted expert parameters — merged level by level)."""
    base = _peft().tuners.tuners_utils.BaseTunerLayer
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, base):
                while isinstance(child, base):
                    if not child.merged:  # merging an outer wrapper can merge the inner
                        child.merge()
                    child = child.base_layer
                setattr(parent, name, child)
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    model.chunked_head = True
    return model
