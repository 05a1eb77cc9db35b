"""The open-model families lathe loads and exports as themselves, one small entry each:
how a family's HF `config.json` sets `ModelConfig`'s switches, which switch values the
family's own transformers class builds (so an export loads back as that class), and the
keys an export writes beside the common ones. Parameter names are HF's for every family
here, so the checkpoint code needs no renaming.

| model_type | class | switches |
|---|---|---|
| llama (also SmolLM2, Llama 3.x) | LlamaForCausalLM | `attention_bias` on q, k, v and o |
| mistral | MistralForCausalLM | none |
| qwen2 (Qwen2.5) | Qwen2ForCausalLM | bias on q, k and v, not o |
| qwen3 | Qwen3ForCausalLM | RMSNorm of each head of q and k; `attention_bias` on all four |
| smollm3 | SmolLM3ForCausalLM | `attention_bias`; no RoPE in the layers `no_rope_layers` marks 0 |

Sliding-window attention (Mistral v0.1's 4096, Qwen's `use_sliding_window`) is not
implemented: a window shorter than the context is refused rather than attended in full.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    architecture: str
    switches: Callable[[dict[str, Any]], dict[str, bool]]  # config.json -> ModelConfig
    window: Callable[[dict[str, Any]], int | None]  # the sliding window config.json asks for
    extra: Callable[[Any], dict[str, Any]]  # ModelConfig -> keys an export adds


def _attention_bias(hf: dict[str, Any]) -> dict[str, bool]:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def _qwen_window(hf: dict[str, Any]) -> int | None:
    return hf.get("sliding_window") if hf.get("use_sliding_window") else None


def _qwen_extra(config: Any) -> dict[str, Any]:
    return {"use_sliding_window": False, "sliding_window": None,
            "max_window_layers": config.n_layers}


FAMILIES: dict[str, Family] = {
    "llama": Family(
        "LlamaForCausalLM", _attention_bias, lambda hf: None,
        lambda c: {"attention_bias": c.qkv_bias, "mlp_bias": False, "pretraining_tp": 1}),
    "mistral": Family(
        "MistralForCausalLM", lambda hf: {}, lambda hf: hf.get("sliding_window"),
        lambda c: {"sliding_window": None}),
    "qwen2": Family(
        "Qwen2ForCausalLM", lambda hf: {"qkv_bias": True}, _qwen_window, _qwen_extra),
    "qwen3": Family(
        "Qwen3ForCausalLM", lambda hf: {"qk_norm": True, **_attention_bias(hf)}, _qwen_window,
        lambda c: {"attention_bias": c.qkv_bias, **_qwen_extra(c)}),
    "smollm3": Family(
        "SmolLM3ForCausalLM", _attention_bias, _qwen_window,
        lambda c: {"attention_bias": c.qkv_bias, "mlp_bias": False,
                   "no_rope_layers": list(c.no_rope_layers or [1] * c.n_layers),
                   "use_sliding_window": False, "sliding_window": None}),
}

SWITCHES = ("qkv_bias", "o_bias", "qk_norm")


def family_switches(model_type: str, config: Any) -> dict[str, bool]:
    """The switch values `model_type`'s own class builds for `config`'s bias setting
    (what a `ModelConfig` of that family must hold for its export to load back)."""
    hf = {"attention_bias": config.qkv_bias}
    return {name: False for name in SWITCHES} | FAMILIES[model_type].switches(hf)
