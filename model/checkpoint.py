"""Checkpoint I/O in Hugging Face Llama layout: the contract between every lathe stage.

A checkpoint folder holds `config.json` (an HF `LlamaConfig`), `model.safetensors`
(or shards plus `model.safetensors.index.json`), `generation_config.json`, the
tokenizer files when there is a tokenizer, and `lathe.json` (provenance). Because
`Transformer` uses HF's parameter names, saving is a save and loading is a load: no
renaming. Folders written by `transformers`' `save_pretrained` for a Llama model load
too. Training state (optimizer, RNG, data position) is never in here.
"""

from __future__ import annotations

import datetime
import json
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file
from tokenizers import Tokenizer

from lathe.model.atomic import atomic_directory
from lathe.model.config import ModelConfig
from lathe.model.transformer import Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
PROVENANCE_FILE = "lathe.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
DEFAULT_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, malformed, or does not match its config."""


def save_checkpoint(model: Transformer, path: str | Path, tokenizer: str | Path | None = None,
                    provenance: dict[str, Any] | None = None, *,
                    max_shard_size: int | str = "5GB") -> Path:
    """Write `model` as an HF-layout checkpoint folder at `path`, atomically.

    `tokenizer` is a folder holding at least `tokenizer.json` (as written by
    `lathe tokenizer train` or `save_pretrained`); its files are copied in and its
    bos/eos/pad tokens set the ids in config.json and generation_config.json.
    `provenance` (stage, steps, data, metrics, ...) goes to lathe.json. Weights are
    split into shards past `max_shard_size`.
    """
    config = model.config
    special_ids = _special_token_ids(Path(tokenizer), config) if tokenizer is not None else {}
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if not (config.tie_embeddings and name == "lm_head.weight")
    }
    dtype = next(iter(state.values())).dtype
    with atomic_directory(path) as tmp:
        save_torch_state_dict(state, tmp, max_shard_size=max_shard_size,
                              metadata={"format": "pt"})
        hf_config = config.to_hf_config()
        hf_config.update(torch_dtype=str(dtype).removeprefix("torch."), **special_ids)
        _write_json(tmp / CONFIG_FILE, hf_config)
        _write_json(tmp / GENERATION_CONFIG_FILE, {**special_ids, **DEFAULT_SAMPLING})
        if tokenizer is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer) / name).is_file():
                    shutil.copy2(Path(tokenizer) / name, tmp / name)
        _write_json(tmp / PROVENANCE_FILE, {
            "lathe_version": _lathe_version(),
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "parameters": config.num_params(),
            **(provenance or {}),
        })
    return Path(path)


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
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        # safetensors accepts "cpu" but not the "cpu:0" multi-process CPU launches use
        state.update(load_file(file, device="cpu" if device.type == "cpu" else str(device)))
    with torch.device("meta"):
        model = Transformer(config)
    _check_state_dict(model, state, path)
    if dtype is not None:
        state = {name: tensor.to(dtype) for name, tensor in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb.reset_parameters(device)
    return model.eval()


def read_model_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of a checkpoint folder, from its config.json."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(
            f"{path}: no {CONFIG_FILE}; a checkpoint is a folder with {CONFIG_FILE} and "
            f"{WEIGHTS_FILE} (write one with `lathe init` or save_checkpoint)"
        )
    return ModelConfig.from_hf_config(json.loads(file.read_text()))


def _weight_files(path: Path) -> list[Path]:
    if (path / WEIGHTS_INDEX_FILE).is_file():
        weight_map = json.loads((path / WEIGHTS_INDEX_FILE).read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shard(s) named in {WEIGHTS_INDEX_FILE} are missing: "
                                  f"{', '.join(missing)}")
        return files
    if (path / WEIGHTS_FILE).is_file():
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
    mis_shaped = [
        f"{name} {tuple(state[name].shape)} (config expects {expected[name]})"
        for name in sorted(set(expected) & set(state))
        if tuple(state[name].shape) != expected[name]
    ]
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}"
        for label, items in (("missing", missing), ("unexpected", unexpected),
                             ("mis-shaped", mis_shaped))
        if items
    ]
    if problems:
        raise CheckpointError(
            f"{path}: weights do not match config.json — " + "; ".join(problems)
            + ". Was the folder written for a different model shape?"
        )


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
