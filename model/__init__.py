"""lathe.model: the one transformer every stage uses, its config presets, and checkpoint I/O.

Owns the Llama-architecture `Transformer` (HF parameter names, rotate-half RoPE, GQA),
`ModelConfig` and its presets, the KV-cache interface, reference generation, LoRA
adapters as peft folders, and the checkpoint contract (HF Llama layout). It knows nothing
of training: parallelism, precision and losses over sharded heads are the runtime's.
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
from lathe.model.transformer import IGNORE_INDEX, CausalLMOutput, Transformer

__all__ = [
    "IGNORE_INDEX",
    "PRESETS",
    "CausalLMOutput",
    "CheckpointError",
    "ContiguousKVCache",
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "generate",
    "load_checkpoint",
    "read_model_config",
    "save_checkpoint",
]
