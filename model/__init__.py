"""lathe.model: the one transformer every stage uses, its config presets, and checkpoint I/O.

Owns the Llama-architecture `Transformer` (HF parameter names, rotate-half RoPE, GQA),
`ModelConfig` and its presets, the KV-cache interface, reference generation, the
checkpoint contract (HF Llama layout), atomic folder writes, and the typed-config
loader every stage's recipe goes through.
"""

from lathe.model.checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_model_config,
    save_checkpoint,
)
from lathe.model.config import PRESETS, ModelConfig, RopeScaling
from lathe.model.generate import generate
from lathe.model.kv_cache import ContiguousKVCache, KVCache
from lathe.model.recipe import ConfigError, load_config
from lathe.model.transformer import IGNORE_INDEX, CausalLMOutput, Transformer

__all__ = [
    "IGNORE_INDEX",
    "PRESETS",
    "CausalLMOutput",
    "CheckpointError",
    "ConfigError",
    "ContiguousKVCache",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "generate",
    "load_checkpoint",
    "load_config",
    "read_model_config",
    "save_checkpoint",
]
