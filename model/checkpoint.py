"""Checkpoint I/O in Hugging Face Llama layout: the contract between every lathe stage.

A checkpoint folder holds `config.json` (an HF `LlamaConfig`), `model.safetensors`
(or shards plus `model.safetensors.index.json`), `generation_config.json`, the
tokenizer files when there is a tokenizer, and `lathe.json` (provenance). Because
`Transformer` uses HF's parameter names, saving is a save and loading is a load: no
renaming. Folders written by `transformers`' `save_pretrained` for a Llama model load
too. Training state (optimizer, RNG, data position) is never in here.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer

from lathe.core.atomic import atomic_directory
from lathe.core.checkpoint_files import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    checkpoint_file,
    read_config_json,
    read_eos_ids,
    read_json_if_present,
    read_json_object,
    read_processor_template,
)
from lathe.core.errors import CheckpointError, ConfigError
from lathe.model.config import ModelConfig
from lathe.model.families import (
    IGNORED_PREFIXES,
    drop_shared_kv,
    join_fused,
    language_model_config,
    language_model_weights,
    split_fused,
    stack_experts,
    unstack_experts,
)
from lathe.model.fp8_weights import dequantize_fp8, fp8_format
from lathe.model.transformer import FP32_BUFFERS, Transformer

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
PROVENANCE_FILE = "lathe.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
SPECIAL_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


# config.json fields read as numbers, and the type each must have
_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "max_position_embeddings", "head_dim")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "initializer_range")


def load_safetensors(file: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; a truncated or corrupt file is a
    `CheckpointError` naming it."""
    try:
        # safetensors accepts "cpu" but not the "cpu:0" multi-process CPU launches use
        return load_file(file, device="cpu" if device.type == "cpu" else str(device))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file}: not a readable safetensors file ({error}); it is "
                              "truncated or corrupt — copy or export it again") from None


def save_checkpoint(model: Transformer, path: str | Path, tokenizer: str | Path | None = None,
                    provenance: dict[str, Any] | None = None, *,
                    max_shard_size: int | str = "5GB",
                    chat_template: str | None = None) -> Path:
    """Write `model` as an HF-layout checkpoint folder at `path`, atomically.

    `tokenizer` is a folder holding at least `tokenizer.json` (as written by
    `lathe tokenizer train` or `save_pretrained`); its files are copied in and its
    bos/eos/pad tokens set the ids in config.json and generation_config.json. When it is
    a checkpoint (a stage's source model), its generation_config.json is kept as it was —
    an instruct model's list of end-of-turn ids and its sampling defaults — and its
    config.json's bos/eos/pad ids win over the tokenizer's single tokens.
    `chat_template` (Jinja source) replaces the template those files carry, in
    tokenizer_config.json where transformers, vLLM and lathe read it.
    `provenance` (stage, steps, data, metrics, ...) goes to lathe.json. Weights are
    split into shards past `max_shard_size`.
    """
    config = model.config
    special_ids = _special_token_ids(Path(tokenizer), config) if tokenizer is not None else {}
    generation = dict(special_ids)
    if tokenizer is not None:
        special_ids.update(_source_fields(Path(tokenizer) / CONFIG_FILE, SPECIAL_ID_FIELDS))
        generation = {**special_ids, **_source_fields(Path(tokenizer) / GENERATION_CONFIG_FILE)}
    state = hf_layout(model.state_dict(), config)
    dtype = next(iter(state.values())).dtype
    with atomic_directory(path) as tmp:
        save_torch_state_dict(state, tmp, max_shard_size=max_shard_size,
                              metadata={"format": "pt"})
        hf_config = config.to_hf_config()
        hf_config.update(torch_dtype=str(dtype).removeprefix("torch."), **special_ids)
        _write_json(tmp / CONFIG_FILE, hf_config)
        _write_json(tmp / GENERATION_CONFIG_FILE, generation)
        if tokenizer is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer) / name).is_file():
                    shutil.copy2(Path(tokenizer) / name, tmp / name)
            _keep_processor_template(Path(tokenizer), tmp)
        if chat_template is not None:
            _replace_chat_template(tmp, chat_template)
        _write_json(tmp / PROVENANCE_FILE, {
            "lathe_version": _lathe_version(),
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "parameters": config.num_params(),
            **(provenance or {}),
        })
    return Path(path)


def hf_layout(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A model's state dict as its family's checkpoints store it: projections fused where
    the family fuses them, experts one by one, a tied LM head left out (whole rows moved,
    so per-row quantities of the weights map the same way)."""
    return unstack_experts(join_fused({
        name: tensor.detach().contiguous() for name, tensor in state.items()
        if not (config.tie_embeddings and name == "lm_head.weight")}, config), config)


def write_weights(state: dict[str, torch.Tensor], config: ModelConfig, path: str | Path,
                  max_shard_size: int | str = "5GB") -> Path:
    """Only the weights of a checkpoint (its safetensors shards, HF layout), atomically: a
    trainer's push of new weights to an engine that already holds the model
    (`read_weights`)."""
    with atomic_directory(path) as tmp:
        save_torch_state_dict(hf_layout(state, config), tmp, max_shard_size=max_shard_size,
                              metadata={"format": "pt"})
    return Path(path)


def read_weights(path: str | Path, config: ModelConfig,
                 device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The weights of a checkpoint folder (or one `write_weights` wrote) as a `Transformer`
    of `config` names them, checked against it: one `CheckpointError` naming what is
    missing, unexpected or mis-shaped."""
    path = Path(path)
    state = _read_state(path, config, torch.device(device))
    with torch.device("meta"):
        _check_state_dict(Transformer(config), state, path)
    return state


def _keep_processor_template(source: Path, folder: Path) -> None:
    """A multimodal processor's chat template (Gemma 3's), where the tokenizer files carry
    none, written as the text model's chat_template.jinja."""
    config_file = folder / "tokenizer_config.json"
    if (folder / "chat_template.jinja").is_file() or (
            config_file.is_file() and read_json_object(config_file).get("chat_template")):
        return
    template = read_processor_template(source)
    if template is not None:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")


def _replace_chat_template(folder: Path, template: str) -> None:
    config_file = folder / "tokenizer_config.json"
    config = read_json_object(config_file) if config_file.is_file() else {}
    _write_json(config_file, {**config, "chat_template": template})
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # one template, not two


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> Transformer:
    """Load a checkpoint folder (lathe's or `save_pretrained`'s) as a `Transformer` in eval mode.

    Weights keep their stored dtype unless `dtype` is given. Every tensor is checked
    against the config: missing, unexpected and mis-shaped names are reported together
    in one `CheckpointError`.
    """
    path = Path(path)
    config = read_model_config(path)
    device = torch.device(device if device is not None else "cpu")
    check_memory(config, path, device, dtype)
    return _build(config, _read_state(path, config, device, dtype), path, dtype, device)


def skeleton(config: ModelConfig) -> Transformer:
    """A `Transformer` of `config` whose weights are on the meta device (no memory, nothing
    read or initialized) and whose RoPE frequencies (buffers outside the state dict) are
    computed: what a rank builds when another sends it the weights — FSDP2's
    cpu_ram_efficient_loading, in which the main process alone holds a full copy."""
    with torch.device("meta"):
        model = Transformer(config)
    model.tie_weights()
    model.reset_rotary("cpu")
    return model.eval()


class OpenCheckpoint:
    """A checkpoint folder opened once for a run that builds several models from it (GRPO's
    policy, frozen reference and rollout copy; distillation's teacher for training and for
    its score): config.json and generation_config.json read and checked once, the weights
    read once into CPU memory and each `model()` a copy of them. `release()` frees the kept
    weights once every model is built."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = read_model_config(self.path)
        self.eos_ids = read_eos_ids(self.path, self.config.vocab_size)
        self._state: dict[str, torch.Tensor] | None = None

    def model(self, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None,
              num_labels: int | None = None) -> Transformer:
        """A new `Transformer` (eval mode) of these weights, as `load_checkpoint` gives.
        `num_labels` on a language model's checkpoint: a sequence classifier of its decoder
        with a new score head ~ N(0, init_std), as transformers starts one (a reward model
        from an SFT model)."""
        config = self.config_for(num_labels)
        device = torch.device(device if device is not None else "cpu")
        check_memory(self.config, self.path, device, dtype)
        if self._state is None:
            self._state = _read_state(self.path, self.config, torch.device("cpu"))
        state = {name: tensor.to(device, dtype or tensor.dtype, copy=True)
                 for name, tensor in self._state.items()}
        if config.num_labels != self.config.num_labels:
            embedding = state["model.embed_tokens.weight"]
            state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
            state["score.weight"] = torch.randn(
                num_labels, config.dim, device=device).mul_(config.init_std).to(embedding.dtype)
        return _build(config, state, self.path, None, device)

    def config_for(self, num_labels: int | None) -> ModelConfig:
        """The config of the model `model(num_labels=...)` builds."""
        config = self.config
        if num_labels is None or num_labels == config.num_labels:
            return config
        if config.num_labels:
            raise CheckpointError(f"{self.path} is a sequence classifier of "
                                  f"{config.num_labels} labels, not {num_labels}; start "
                                  "from a language model or a classifier of that many")
        return dataclasses.replace(config, num_labels=num_labels)

    def release(self) -> None:
        self._state = None


def _read_state(path: Path, config: ModelConfig, device: torch.device,
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as lathe names them; an FP8 checkpoint's (block-scaled, or
    compressed-tensors') read back to `dtype` (default: its unquantized weights')."""
    # (a trainer's pushed weights have no config.json)
    quantization = read_json_if_present(checkpoint_file(path, CONFIG_FILE)).get(
        "quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    form = fp8_format(quantization, path / CONFIG_FILE)
    if quantization is not None and form is None:
        raise CheckpointError(
            f"{path / CONFIG_FILE}: the weights are quantized ({method}); training, merging "
            "and exporting start from the full-precision checkpoint it was made from "
            "(lathe serve and lathe chat load this one)")
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        state.update(load_safetensors(file, device))
    if form is not None:
        state = dequantize_fp8(state, form, dtype, path)
    return lathe_layout(state, config)


def lathe_layout(state: dict[str, torch.Tensor], config: ModelConfig,
                 per_row: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's state dict (its family's, or a multimodal wrapper's) as a
    `Transformer` of `config` names it: the language model's, fused projections split,
    experts stacked. Every step moves whole rows, so it also maps tensors that hold a
    per-row quantity of each weight (`per_row`: quantization scales, whose columns are
    groups of the weight's) — only their rows are checked."""
    state = drop_shared_kv(language_model_weights(state), config)
    state = {name: tensor for name, tensor in state.items()
             if not name.startswith(IGNORED_PREFIXES)}
    return stack_experts(split_fused(state, config), config, per_row=per_row)


def _build(config: ModelConfig, state: dict[str, torch.Tensor], path: Path,
           dtype: torch.dtype | None, device: torch.device) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    _check_state_dict(model, state, path)
    if dtype is not None:
        state = {name: tensor if name.endswith(FP32_BUFFERS) else tensor.to(dtype)
                 for name, tensor in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.reset_rotary(device)
    return model.eval()


def available_memory(device: torch.device) -> int:
    """Bytes this process could still allocate on `device`: free GPU memory, or the host's
    available memory (MemAvailable on Linux, else physical memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(config: ModelConfig, path: Path, device: torch.device,
                 dtype: torch.dtype | None) -> None:
    """Refuse, before anything is allocated, a config whose weights alone could not fit
    in `device`'s available memory (at `dtype`, or 16 bits a weight at least), naming the
    field that makes it so: a corrupt or hostile config.json must not run the machine out
    of memory while the model is built."""
    width = dtype.itemsize if dtype is not None else 2
    need = config.num_params() * width
    have = available_memory(device)
    if need <= have:
        return
    embeddings = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)
    if embeddings * 2 > config.num_params():
        culprit = f"vocab_size={config.vocab_size} (× hidden_size={config.dim})"
    else:
        per_layer = (config.num_params() - embeddings) // config.n_layers
        culprit = (f"num_hidden_layers={config.n_layers} (× {per_layer:,} parameters a layer "
                   f"from hidden_size={config.dim}, intermediate_size={config.ffn_hidden_dim})")
    raise CheckpointError(
        f"{path / CONFIG_FILE}: {culprit} describes {config.num_params():,} parameters, "
        f"{need / 2**30:,.1f} GiB at {width * 8} bits, but {device} has {have / 2**30:,.1f} GiB "
        "available; the config is corrupt or the model needs a larger machine")


def read_model_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of a checkpoint folder, from its config.json."""
    file = checkpoint_file(path, CONFIG_FILE)
    try:
        hf = language_model_config(read_config_json(path))
    except ConfigError as error:
        raise CheckpointError(f"{file}: {str(error).removeprefix(CONFIG_FILE + ': ')}") from None
    for name in _INT_FIELDS:
        value = hf.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise CheckpointError(f"{file}: {name}={value!r} must be an integer")
    for name in _FLOAT_FIELDS:
        value = hf.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise CheckpointError(f"{file}: {name}={value!r} must be a number")
    try:
        return ModelConfig.from_hf_config(hf)
    except KeyError as error:
        raise CheckpointError(f"{file}: the field {error} is missing") from None
    except (TypeError, AttributeError, ZeroDivisionError, OverflowError) as error:
        raise CheckpointError(f"{file}: {error}") from None
    except ConfigError as error:  # its messages name config.json already: said once
        raise CheckpointError(f"{file}: {str(error).removeprefix(CONFIG_FILE + ': ')}") from None


def weight_files(path: Path) -> list[Path]:
    index = checkpoint_file(path, WEIGHTS_INDEX_FILE)
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(name, str) for name in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map parameter names to shard "
                                  "file names")
        files = []
        for name in sorted(set(weight_map.values())):
            # a plain file name: "../x" or "/x" would read outside the checkpoint folder
            if not name.endswith(".safetensors") or Path(name).name != name or "\\" in name:
                raise CheckpointError(f"{index}: shard {name!r} must be the name of a "
                                      ".safetensors file in the checkpoint folder")
            files.append(checkpoint_file(path, name))
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shard(s) named in {WEIGHTS_INDEX_FILE} are missing: "
                                  f"{', '.join(missing)}")
        return files
    if checkpoint_file(path, WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    raise CheckpointError(
        f"{path}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}; lathe reads safetensors only "
        "(re-save a transformers model with save_pretrained(..., safe_serialization=True))"
    )


def _check_state_dict(model: Transformer, state: dict[str, torch.Tensor], path: Path) -> None:
    expected = {
        name: tuple(tensor.shape) for name, tensor in model.state_dict().items()
        if not (model.config.tie_embeddings and name == "lm_head.weight")
    }
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    not_float = [f"{name} ({tensor.dtype})" for name, tensor in sorted(state.items())
                 if name in expected and not tensor.is_floating_point()]
    mis_shaped = [
        f"{name} {tuple(state[name].shape)} (config expects {expected[name]})"
        for name in sorted(set(expected) & set(state))
        if tuple(state[name].shape) != expected[name]
    ]
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}"
        for label, items in (("missing", missing), ("unexpected", unexpected),
                             ("mis-shaped", mis_shaped), ("not floating point", not_float))
        if items
    ]
    if problems:
        raise CheckpointError(
            f"{path}: weights do not match config.json — " + "; ".join(problems)
            + ". Was the folder written for a different model shape?"
        )


def _source_fields(file: Path, names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The fields of a source checkpoint's JSON file (only `names` when given; nothing when
    the file is absent)."""
    fields = read_json_if_present(file)
    return {k: v for k, v in fields.items() if names is None or k in names}


def _special_token_ids(tokenizer_dir: Path, config: ModelConfig) -> dict[str, int]:
    tokenizer_file = tokenizer_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(f"tokenizer folder {tokenizer_dir} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > config.vocab_size:
        raise CheckpointError(
            f"tokenizer has {size} tokens but the model's vocab_size is {config.vocab_size}; "
            "build the model with vocab_size >= the tokenizer's size"
        )
    tokenizer_config_file = tokenizer_dir / "tokenizer_config.json"
    tokenizer_config = (json.loads(tokenizer_config_file.read_text())
                        if tokenizer_config_file.is_file() else {})
    ids = {}
    for role in ("bos", "eos", "pad"):
        token = tokenizer_config.get(f"{role}_token")
        if isinstance(token, dict):
            token = token.get("content")
        token_id = tokenizer.token_to_id(token) if token else None
        if token_id is not None:
            ids[f"{role}_token_id"] = token_id
    return ids


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _lathe_version() -> str:
    try:
        return version("lathe")
    except PackageNotFoundError:
        return "unknown"
