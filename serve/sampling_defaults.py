"""A checkpoint's recommended sampling, as vLLM's `--generation-config auto` serves it: the
`temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` of its
generation_config.json are the defaults of every request that does not set them, and its
`max_new_tokens` limits every request's output. Instruct checkpoints ship theirs there
(Qwen3: temperature 0.6, top_p 0.95, top_k 20; Gemma 3: top_k 64, top_p 0.95), and a client
that sends no temperature expects them, not temperature 1. `do_sample` is not read (vLLM
does not either): a request that wants greedy decoding sends temperature 0.

Where they come from is `ServerConfig.generation_config`: "auto" (the checkpoint's file),
"none" (OpenAI's defaults) or another folder's generation_config.json. No torch here: the
server's front end reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lathe.core.checkpoint_files import (
    GENERATION_CONFIG_FILE,
    checkpoint_file,
    read_json_if_present,
)
from lathe.core.errors import CheckpointError
from lathe.serve.sampling_params import BOUNDS, is_number

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# each default -> its generation_config.json key
KEYS = {**{name: name for name in SAMPLING_FIELDS}, "max_tokens": "max_new_tokens"}

# the defaults, with "max_tokens" (from max_new_tokens) the limit of every request's output
SamplingDefaults = dict[str, float | int]


def read_sampling_defaults(folder: str | Path) -> SamplingDefaults:
    """The sampling fields `folder`'s generation_config.json sets (none when it has no such
    file), each checked against the range a request's own must lie in."""
    file = checkpoint_file(folder, GENERATION_CONFIG_FILE)
    raw = read_json_if_present(file)
    defaults: SamplingDefaults = {}
    for name, key in KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        integral = name in ("top_k", "max_tokens")
        if not is_number(value) or (integral and not float(value).is_integer()) \
                or not BOUNDS[name].holds(value):
            kind = "an integer" if integral else "a number"
            raise CheckpointError(f"{file}: {key}={value!r} must be {kind} {BOUNDS[name]}; "
                                  "correct the file, or serve without it (--generation-config "
                                  "none)")
        defaults[name] = int(value) if integral else float(value)
    return defaults


def with_defaults(fields: dict[str, Any], defaults: SamplingDefaults) -> dict[str, Any]:
    """A request's sampling `fields` (None or absent: unset) with `defaults` in what it
    leaves unset, and its max_tokens no more than theirs."""
    merged = dict(fields)
    for name in SAMPLING_FIELDS:
        if merged.get(name) is None and name in defaults:
            merged[name] = defaults[name]
    if "max_tokens" in defaults and merged.get("max_tokens") is not None:
        merged["max_tokens"] = min(merged["max_tokens"], defaults["max_tokens"])
    return merged


def sampling_defaults(source: str, checkpoint: Path) -> SamplingDefaults:
    """The defaults `--generation-config` names: "auto" the checkpoint's, "none" none, else
    the folder's."""
    if source == "none":
        return {}
    return read_sampling_defaults(checkpoint if source == "auto" else Path(source))
