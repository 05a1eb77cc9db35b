"""The open-model families lathe loads and exports as themselves, one small entry each:
how a family's HF `config.json` sets `ModelConfig`'s switches, which switch values the
family's own transformers class builds (so an export loads back as that class), and the
keys an export writes beside the common ones; where its config keeps RoPE apart from the usual
keys (Gemma 3 and OLMo 3 per layer type, Phi-3's names for LongRoPE) and the fields only it reads
(SmolLM3's NoPE layers); its sequence classifier's class (a reward model's). Parameter names
are HF's, but for the projections
a family stores fused (`Family.fused`: Phi-3's `qkv_proj` and `gate_up_proj`), which a load
splits into lathe's q/k/v and gate/up and an export joins again (`split_fused`,
`join_fused`).

| model_type | class | switches |
|---|---|---|
| llama (also SmolLM2, Llama 3.x) | LlamaForCausalLM | `attention_bias` on q, k, v and o |
| mistral | MistralForCausalLM | none |
| qwen2 (Qwen2.5) | Qwen2ForCausalLM | bias on q, k and v, not o |
| qwen3 | Qwen3ForCausalLM | RMSNorm of each head of q and k; `attention_bias` on all four |
| smollm3 | SmolLM3ForCausalLM | `attention_bias`; no RoPE in the layers `no_rope_layers` marks 0 |
| gemma2 | Gemma2ForCausalLM | Gemma's norms and embedding scale (below), `attention_bias` |
| gemma3_text | Gemma3ForCausalLM | Gemma 2's, and an RMSNorm of each head of q and k |
| gemma4_text | Gemma4ForCausalLM | Gemma 3's, plain norms, v normed; full layers apart (below) |
| phi3 (Phi-3, Phi-4-mini) | Phi3ForCausalLM | fused `qkv_proj`, `gate_up_proj`; partial RoPE |
| qwen3_5_text (Qwen3.5) | Qwen3_5ForCausalLM | (1 + w) norms, gated attention; Gated DeltaNets |
| qwen3_5_moe_text | Qwen3_5MoeForCausalLM | Qwen3.5's layers; Qwen2-MoE's experts in every one |
| qwen3_next (Qwen3-Next) | Qwen3NextForCausalLM | Qwen3.5-MoE's, DeltaNet projections fused |
| mixtral | MixtralForCausalLM | experts in every layer (`block_sparse_moe`), top-k renormalized |
| qwen3_moe | Qwen3MoeForCausalLM | Qwen3's attention; experts in the layers not `mlp_only_layers` |
| olmo2 (OLMo 2) | Olmo2ForCausalLM | OLMoE's q/k norms; norms after attention and MLP only |
| olmo3 (OLMo 3) | Olmo3ForCausalLM | OLMo 2's; three of each four layers sliding, their own RoPE |
| olmoe | OlmoeForCausalLM | RMSNorm over the whole q and k projections, `clip_qkv`; experts |
| qwen2_moe (Qwen1.5-MoE) | Qwen2MoeForCausalLM | Qwen2's attention; experts, a shared one |
| glm4_moe (GLM-4.5) | Glm4MoeForCausalLM | partial RoPE, q/k norms optional; DeepSeek-V3's router |

A multimodal checkpoint whose language model is one of these (`WRAPPERS`: Gemma 3 from 4B
up, `gemma3`; Gemma 4, `gemma4`; Mistral Small 3.1 and 3.2, `mistral3`; Qwen3.5, `qwen3_5`
and `qwen3_5_moe`, its multi-token-prediction weights `mtp.` ignored as its class does) loads
as that language model: its `text_config` read as the family's config.json, what it leaves out
filled with the wrapper's transformers defaults for it (a nested config is written as its
difference from them), its weights renamed from the wrapper's and the vision (and audio)
towers' left out (`language_model_weights`); it exports as the text model.

Gemma's: (1 + w) norms, a norm after attention and after the MLP as well, embeddings
times √dim; from config.json, soft-capped scores and logits, `query_pre_attn_scalar`, and
(Gemma 3, whose text model is `gemma3_text`) the sliding layers' own RoPE base.

Gemma 4's full-attention layers have heads of their own width (`global_head_dim`), their
own KV heads (`num_global_key_value_heads`) whose values are their keys' projection
(`attention_k_eq_v`), and "proportional" RoPE; its scores are unscaled (q and k normed), each
head of v normed without weight, each layer's output times its stored `layer_scalar`. E2B and
E4B add per-layer embeddings (`hidden_size_per_layer_input`) and last layers that share an
earlier layer's keys and values (`num_kv_shared_layers`, their MLPs doubled with
`use_double_wide_mlp`): a checkpoint's k/v weights of those layers, which transformers ignores,
are left out (`drop_shared_kv`). 26B-A4B (`enable_moe_block`) adds experts beside each
layer's MLP: lathe's shared expert is that MLP, and the router's input scale and per-expert
scale, the experts and their norms are renamed at the layer's level (`GEMMA4_RENAMES`), where
its class keeps them, stacked.

Qwen3.5's linear-attention layers (`layer_types` "linear_attention", `linear_attn.*`) are
Gated DeltaNet token mixers (`lathe.model.gated_delta_net`) whose shape is its config.json's
`linear_num_key_heads`, `linear_num_value_heads`, their head widths and
`linear_conv_kernel_dim`; its full-attention layers' q_proj is twice as wide, each head
followed by the gate of its output. Its text-only positions make its interleaved
multimodal RoPE the plain partial one. Qwen3-Next, its predecessor, computes the same layers
(with Qwen2-MoE's experts where `mlp_only_layers` and `decoder_sparse_step` leave them) but
stores each DeltaNet's q, k, v and z projections as one `in_proj_qkvz` and its b and a as
`in_proj_ba`, their rows grouped by key head (`fused_rows`).

Sliding windows: Mistral's `sliding_window` covers every layer; Qwen2/3's and SmolLM3's
(`use_sliding_window`) cover the layers `layer_types` marks, by default those from
`max_window_layers` on (Qwen) or those without RoPE (SmolLM3); Gemma's alternate (every
other layer in Gemma 2, five of each six in Gemma 3), as their config classes fill them in.
An export writes `layer_types` out whole.

Experts: lathe holds each MoE layer's experts stacked, as transformers 5 does in memory
(`mlp.experts.gate_up_proj` (E, 2·I, D), `mlp.experts.down_proj` (E, D, I)) beside the router
`mlp.gate.weight`. A checkpoint may store them that way (the fused layout) or one tensor per
expert and projection (`mlp.experts.3.gate_proj.weight`; Mixtral's
`block_sparse_moe.experts.3.w1.weight`), as transformers' `save_pretrained` writes and vLLM
and llama.cpp read: a load stacks the per-expert layout (`stack_experts`) and refuses a
missing or mis-shaped expert by name; an export writes it (`unstack_experts`). GLM-4.5's
shared MLP is `mlp.shared_experts` (lathe's `mlp.shared_expert`), and its checkpoints carry
multi-token-prediction layers past `num_hidden_layers`, which its class ignores and so does a
load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lathe.core.errors import CheckpointError, ConfigError

Window = tuple[int | None, list[str] | None]  # ModelConfig's sliding_window, layer_types


@dataclass(frozen=True)
class ExpertLayout:
    """How a mixture-of-experts family names and configures its experts."""

    block: str  # the MoE block in checkpoints: "mlp", Mixtral's "block_sparse_moe"
    projections: tuple[str, str, str]  # one expert's gate, up and down projections
    read: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> ModelConfig fields
    written: Callable[[Any], dict[str, Any]]  # ModelConfig -> config.json keys
    # what its class varies: "moe_layers" (only "dense_first": the first k layers dense),
    # "norm_topk_prob", "shared_expert" (a width, or "shared_multiple": n × the experts');
    # "mtp_layers": checkpoints may hold layers past num_hidden_layers, ignored; "optional":
    # the family is dense unless its config.json asks for experts; "beside_mlp": Gemma 4's
    # (`ModelConfig.experts_beside_mlp`); "stacked": its class saves the experts stacked
    options: tuple[str, ...] = ()
    shared: str = "shared_expert"  # the shared MLP's name in checkpoints
    # (checkpoint name, lathe name) of a MoE layer's parameters, after `model.layers.N.`,
    # where a family's class keeps them outside its MLP block (Gemma 4)
    renames: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Family:
    architecture: str
    switches: Callable[[dict[str, Any]], dict[str, bool]]  # config.json -> ModelConfig
    window: Callable[[dict[str, Any]], Window]  # the sliding window config.json asks for
    extra: Callable[[Any], dict[str, Any]]  # ModelConfig -> keys an export adds
    sliding: str = "none"  # which windows its class builds: "none", "all" layers, "layers"
    takes: tuple[str, ...] = ()  # the optional ModelConfig fields its class reads
    fused: tuple[str, ...] = ()  # FUSED projections its checkpoints store as one
    experts: ExpertLayout | None = None  # a mixture of experts: how it stores them
    # its sequence classifier's class (a reward model's) where that is not the causal
    # class's name with ForSequenceClassification; "" where transformers has none
    classifier_class: str | None = None
    # config.json -> (the RoPE parameters of its full-attention layers, with their
    # rope_type; its RoPE base): where a family keeps them apart from the usual keys
    rope: Callable[[dict[str, Any]], tuple[dict[str, Any], float]] = (
        lambda hf: _rope_parameters(hf))
    # config.json -> the ModelConfig fields only this family reads (SmolLM3's NoPE layers,
    # Gemma 3's local RoPE base)
    read: Callable[[dict[str, Any]], dict[str, Any]] = lambda hf: {}

    @property
    def classifier(self) -> str | None:
        """HF's `…ForSequenceClassification` class of the family, None when it has none."""
        if self.classifier_class is not None:
            return self.classifier_class or None
        return self.architecture.removesuffix("ForCausalLM") + "ForSequenceClassification"


# a fused projection -> the projections it stacks (along the output dimension, in order;
# Qwen3-Next's Gated DeltaNet ones interleave them by key head, `fused_rows`)
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "linear_attn.in_proj_qkvz": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
         "linear_attn.in_proj_ba": ("linear_attn.in_proj_b", "linear_attn.in_proj_a")}
PHI3_FUSED = ("self_attn.qkv_proj", "mlp.gate_up_proj")
QWEN3_NEXT_FUSED = ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba")


def _rope_parameters(hf: dict[str, Any], default_theta: float = 10000.0
                     ) -> tuple[dict[str, Any], float]:
    """RoPE as most configs hold it: `rope_parameters` (transformers 5) or `rope_scaling`
    (4.x), the base at the top level or among them; rope_type "default" when unscaled."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope, float(hf.get("rope_theta") or rope.get("rope_theta") or default_theta)


def _phi3_rope(hf: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Phi-3's own names for LongRoPE ("su", and "yarn" in some configs), as transformers
    reads them."""
    rope, theta = _rope_parameters(hf)
    if rope["rope_type"] in ("su", "yarn"):
        rope["rope_type"] = "longrope"
    return rope, theta


def _per_layer_type_rope(default_theta: float
                         ) -> Callable[[dict[str, Any]], tuple[dict[str, Any], float]]:
    """RoPE kept per layer type (Gemma 3, OLMo 3): the full-attention layers'."""
    def rope(hf: dict[str, Any]) -> tuple[dict[str, Any], float]:
        kept = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        return _rope_parameters({**hf, "rope_parameters": kept.get("full_attention", kept)},
                                default_theta)
    return rope


def _sliding_rope_read(default_theta: float | None
                       ) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The sliding layers' RoPE base (unscaled), as `rope_local_theta`: their own entry's,
    else Gemma 3's older key, else `default_theta` (None: the full layers' base)."""
    def read(hf: dict[str, Any]) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        local = rope.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"config.json: the sliding layers' rope type "
                              f"{local['rope_type']!r} is not supported (only 'default')")
        theta = local.get("rope_theta") or hf.get("rope_local_base_freq") or default_theta
        return {"rope_local_theta": float(theta if theta is not None else
                                          _per_layer_type_rope(500_000.0)(hf)[1])}
    return read


def _smollm3_read(hf: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3's per-layer RoPE flags, or its default: every `no_rope_layer_interval`-th
    layer without (as transformers fills them in)."""
    if hf.get("no_rope_layers") is not None:
        return {"no_rope_layers": list(hf["no_rope_layers"])}
    interval = hf.get("no_rope_layer_interval", 4)
    return {"no_rope_layers": [int((i + 1) % interval != 0)
                               for i in range(hf["num_hidden_layers"])]}


def _attention_bias(hf: dict[str, Any]) -> dict[str, bool]:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def _no_window(hf: dict[str, Any]) -> Window:
    return None, None


def _mistral_window(hf: dict[str, Any]) -> Window:
    if hf.get("layer_types"):
            raise ConfigError(f"config.json: layer_types={hf['layer_types']!r} is not supported "
                          f"for {hf.get('model_type')}: its class slides every layer "
                          "(alternating layers are Ministral's, which lathe does not load)")
    return hf.get("sliding_window"), None


def _qwen_window(hf: dict[str, Any]) -> Window:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is None:
        return None, None
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(hf["num_hidden_layers"])]
    return window, list(types)


def _smollm3_window(hf: dict[str, Any]) -> Window:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is None:
        return None, None
    rotating = hf.get("no_rope_layers") or [1] * hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["full_attention" if rotates else "sliding_attention"
                                      for rotates in rotating]
    return window, list(types)


def _gemma_window(pattern: int) -> Callable[[dict[str, Any]], Window]:
    def window(hf: dict[str, Any]) -> Window:
        every = hf.get("sliding_window_pattern", pattern)
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % every else "full_attention"
            for i in range(hf["num_hidden_layers"])]
        return hf.get("sliding_window", 4096), list(types)
    return window


def _olmo3_window(hf: dict[str, Any]) -> Window:
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention"
        for i in range(hf["num_hidden_layers"])]
    return hf.get("sliding_window", 4096), list(types)


def _olmo3_extra(c: Any) -> dict[str, Any]:
    """OLMo 3's window, and its RoPE per layer type written out whole (its config class,
    given the top-level `rope_theta` alone, would give the sliding layers its default base)."""
    full = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.hf_rope_scaling() or {})}
    sliding = {"rope_type": "default", "rope_theta": c.rope_local_theta or c.rope_theta}
    return {"attention_bias": c.qkv_bias, "sliding_window": c.sliding_window,
            "layer_types": c.layer_types,
            "rope_parameters": {"full_attention": full, "sliding_attention": sliding}}


def _gemma4_window(hf: dict[str, Any]) -> Window:
    """Gemma 3's five sliding layers of each six, the last layer always full (its config class
    makes it so)."""
    window, types = _gemma_window(6)(hf)
    return window, [*types[:-1], "full_attention"]


def _gemma4_rope(hf: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The full layers' RoPE base and scaling; their "proportional" share is `_gemma4_read`'s."""
    rope, theta = _per_layer_type_rope(1_000_000.0)(hf)
    if rope["rope_type"] not in ("default", "proportional"):
        raise ConfigError(f"config.json: the full-attention layers' rope type "
                          f"{rope['rope_type']!r} is not supported (only 'proportional', "
                          "'default')")
    factor = rope.get("factor", 1.0) if rope["rope_type"] == "proportional" else 1.0
    return ({"rope_type": "linear", "factor": factor} if factor != 1.0
            else {"rope_type": "default"}), theta


def _gemma4_read(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's full-attention layers (their head width and KV heads: config.json's
    `global_head_dim` and `num_global_key_value_heads`, or a newer transformers'
    `per_layer_config`; keys as values; proportional RoPE), the sliding layers' RoPE base, and
    E2B's and E4B's per-layer inputs and KV-sharing layers (26B-A4B's experts are
    `GEMMA4_EXPERTS`')."""
    per_layer_dim = hf.get("hidden_size_per_layer_input", 256) or 0  # the class's default
    per_layer_vocab = hf.get("vocab_size_per_layer_input", 262_144)
    if per_layer_dim and per_layer_vocab != hf.get("vocab_size"):
        raise ConfigError(f"config.json: vocab_size_per_layer_input={per_layer_vocab!r} is not "
                          f"supported: lathe's per-layer table has a row for each of the "
                          f"vocab_size={hf.get('vocab_size')!r} tokens (as Gemma 4's own)")
    k_is_v = bool(hf.get("attention_k_eq_v", False))
    layer_types = _gemma4_window(hf)[1]
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    if "per_layer_config" in hf:
        given = {int(k): dict(v or {}) for k, v in (hf["per_layer_config"] or {}).items()}
        shapes = {i: given.get(i, {}) for i in full}
        odd = sorted(set(given) - set(full)) or sorted(
            i for i in full if shapes[i] != shapes[full[0]]
            or set(shapes[i]) - {"head_dim", "num_key_value_heads"})
        if odd:
            raise ConfigError(f"config.json: per_layer_config[{odd[0]}]={given.get(odd[0])!r} "
                              "is not supported: lathe takes one head_dim and num_key_value_heads"
                              " for all full-attention layers, and none for the sliding ones")
        override = shapes[full[0]]
        head_dim, kv_heads = override.get("head_dim"), override.get("num_key_value_heads")
    else:
        head_dim = hf.get("global_head_dim", 512)
        kv_heads = hf.get("num_global_key_value_heads") if k_is_v else None
    if kv_heads is not None and not k_is_v:
        raise ConfigError(f"config.json: full-attention layers with num_key_value_heads="
                          f"{kv_heads!r} but attention_k_eq_v=false are not supported")
    rope = (hf.get("rope_parameters") or {}).get("full_attention") or {}
    proportional = rope.get("rope_type") == "proportional"
    return {"global_head_dim": head_dim, "global_n_kv_heads": kv_heads, "global_k_is_v": k_is_v,
            "rope_proportion": float(rope.get("partial_rotary_factor", 1.0))
            if proportional else None, "query_pre_attn_scalar": 1.0,
            "per_layer_dim": per_layer_dim, "kv_shared_layers": hf.get("num_kv_shared_layers", 0),
            "double_wide_shared_mlp": bool(hf.get("use_double_wide_mlp", False)),
            **_sliding_rope_read(10000.0)(hf)}


def _gemma4_extra(c: Any) -> dict[str, Any]:
    proportional = {"rope_type": "proportional", "partial_rotary_factor": c.rope_proportion} \
        if c.rope_proportion is not None else {"rope_type": "default"}
    scaling = c.hf_rope_scaling()
    full = {**proportional, "rope_theta": c.rope_theta,
            **({"factor": scaling["factor"]} if scaling else {})}
    return {"attention_bias": c.qkv_bias, "hidden_activation": c.hidden_act,
            "final_logit_softcapping": c.final_softcap, "sliding_window": c.sliding_window,
            "layer_types": c.layer_types, "rope_scaling": None,
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": c.rope_local_theta}},
            "global_head_dim": c.global_shape[1], "num_global_key_value_heads":
            c.global_n_kv_heads, "attention_k_eq_v": c.global_k_is_v,
            "hidden_size_per_layer_input": c.per_layer_dim,
            "vocab_size_per_layer_input": c.vocab_size, "num_kv_shared_layers": c.kv_shared_layers,
            **GEMMA4_EXPERTS.written(c), "use_double_wide_mlp": c.double_wide_shared_mlp,
            "use_bidirectional_attention": None}


def _qwen3_5_layers(hf: dict[str, Any]) -> Window:
    """Qwen3.5's Gated DeltaNet and full-attention layers (three linear of each four by
    its class's default, `full_attention_interval`); it has no sliding window."""
    if hf.get("sliding_window") and hf.get("use_sliding_window"):
        raise ConfigError(f"config.json: sliding_window={hf['sliding_window']!r} is not "
                          f"supported for {hf.get('model_type')}: its attention layers are full")
    every = hf.get("full_attention_interval", 4)
    if not hf.get("layer_types") and (not isinstance(every, int) or isinstance(every, bool)
                                      or every < 1):
        raise ConfigError(f"config.json: full_attention_interval={every!r} must be a positive "
                          "integer (every how many layers one attends)")
    types = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % every else "full_attention"
        for i in range(hf["num_hidden_layers"])]
    return None, list(types)


# Qwen3_5TextConfig's defaults for its Gated DeltaNet layers: config.json key -> ModelConfig
QWEN3_5_LINEAR = {"linear_num_key_heads": ("linear_key_heads", 16),
                  "linear_num_value_heads": ("linear_value_heads", 32),
                  "linear_key_head_dim": ("linear_key_head_dim", 128),
                  "linear_value_head_dim": ("linear_value_head_dim", 128),
                  "linear_conv_kernel_dim": ("linear_conv_kernel", 4)}
LINEAR_FIELDS = tuple(ours for ours, _ in QWEN3_5_LINEAR.values())  # the fields they set
QWEN3_5_TAKES = ("partial_rotary_factor", *LINEAR_FIELDS)


def _qwen3_5_switches(hf: dict[str, Any]) -> dict[str, bool]:
    """Qwen3's per-head q/k norms, (1 + w) norms, and its attention's output gate."""
    return {"qk_norm": True, "norm_unit_offset": True, "attn_output_gate": True,
            **_attention_bias(hf)}


def _qwen3_5_read(hf: dict[str, Any]) -> dict[str, Any]:
    """The Gated DeltaNet's shape, and a quarter of each head turned by RoPE where neither
    its RoPE parameters nor the top level say (its class's defaults for absent keys)."""
    if hf.get("attn_output_gate") is False:  # an old key; Qwen3.5's and Next's classes gate
        raise ConfigError("config.json: attn_output_gate=false is not supported: Qwen3.5's "
                          "attention gates its output")
    rope = hf.get("rope_parameters")
    given = (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) \
        or hf.get("partial_rotary_factor")
    return {**({} if given else {"partial_rotary_factor": 0.25}),
            **{ours: default if hf.get(key) is None else hf[key]
               for key, (ours, default) in QWEN3_5_LINEAR.items()}}


def _qwen3_5_extra(c: Any) -> dict[str, Any]:
    """Qwen3.5's layer kinds, Gated DeltaNet shape and RoPE (its partial rotation among the
    RoPE parameters, where its class reads it)."""
    return {"attention_bias": c.qkv_bias, "layer_types": c.layer_types, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.partial_rotary_factor},
            **{key: getattr(c, ours) for key, (ours, _) in QWEN3_5_LINEAR.items()}}


def _whole(value: float | None) -> float | int | None:
    return int(value) if value is not None and float(value).is_integer() else value


def _gemma_extra(config: Any) -> dict[str, Any]:
    return {"attention_bias": config.qkv_bias, "hidden_activation": config.hidden_act,
            # an int in transformers' config classes (256, 144, ...)
            "query_pre_attn_scalar": _whole(config.query_pre_attn_scalar),
            "attn_logit_softcapping": config.attn_softcap,
            "final_logit_softcapping": config.final_softcap,
            "sliding_window": config.sliding_window, "layer_types": config.layer_types}


GEMMA = {"norm_unit_offset": True, "sandwich_norms": True, "embed_scale": True}
# Gemma 4's norms scale by their weight alone, and its attention does not scale scores (q and
# k are normed); v is normed too, and each layer's output scaled by its stored scalar
GEMMA4 = {"sandwich_norms": True, "embed_scale": True, "qk_norm": True, "v_norm": True,
          "layer_scalar": True, "query_pre_attn_scalar": 1.0}
GEMMA4_FIELDS = ("query_pre_attn_scalar", "final_softcap", "rope_local_theta", "global_head_dim",
                 "global_n_kv_heads", "global_k_is_v", "rope_proportion", "per_layer_dim",
                 "kv_shared_layers", "double_wide_shared_mlp")
OLMO2 = {"qk_norm_projection": True, "post_norms": True}
GEMMA_FIELDS = ("query_pre_attn_scalar", "attn_softcap", "final_softcap")


def _windows_written(config: Any) -> dict[str, Any]:
    """Qwen's and SmolLM3's window keys: the layer types written out whole."""
    types = config.layer_types or ["sliding_attention" if config.sliding_window else
                                   "full_attention"] * config.n_layers
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    return {"use_sliding_window": config.sliding_window is not None,
            "sliding_window": config.sliding_window, "layer_types": types,
            "max_window_layers": sliding[0] if sliding else config.n_layers}


def _experts_read(hf: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The expert fields of config.json, with its class's defaults for absent keys."""
    hf = {**defaults, **{k: v for k, v in hf.items() if v is not None}}
    if hf.get("router_jitter_noise"):
        raise ConfigError(f"config.json: router_jitter_noise={hf['router_jitter_noise']!r} is "
                          "not supported (only 0: lathe's router is deterministic)")
    n_layers = hf["num_hidden_layers"]
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    layers = [int(i not in dense and (i + 1) % step == 0) for i in range(n_layers)]
    return {"n_experts": hf.get("num_local_experts") or hf["num_experts"],
            "n_experts_per_token": hf["num_experts_per_tok"],
            "moe_ffn_hidden_dim": hf.get("moe_intermediate_size") or hf["intermediate_size"],
            "moe_layers": None if all(layers) else layers,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "router_aux_loss_coef": hf["router_aux_loss_coef"],
            # transformers' forward adds the balance loss only when this is on (its classes'
            # default: off); a post-training stage sets it as TRL's trainers do
            # (lathe.posttrain.common.balance_experts)
            "router_aux_loss": bool(hf.get("output_router_logits", False))}


def _experts_written(config: Any) -> dict[str, Any]:
    return {"num_experts_per_tok": config.n_experts_per_token,
            "router_aux_loss_coef": config.router_aux_loss_coef,
            "output_router_logits": config.router_aux_loss}


def _qwen3_moe_written(config: Any) -> dict[str, Any]:
    layers = config.moe_layers or [1] * config.n_layers
    return {**_experts_written(config), "num_experts": config.n_experts,
            "moe_intermediate_size": config.moe_ffn_hidden_dim,
            "norm_topk_prob": config.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, moe in enumerate(layers) if not moe]}


STACKED = ("gate_proj", "up_proj", "down_proj")  # lathe's names of an expert's projections
MIXTRAL_EXPERTS = ExpertLayout(
    "block_sparse_moe", ("w1", "w3", "w2"),
    lambda hf: _experts_read(hf, {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}),
    lambda c: {**_experts_written(c), "num_local_experts": c.n_experts,
               "router_jitter_noise": 0.0})
QWEN3_MOE_EXPERTS = ExpertLayout(
    "mlp", STACKED,
    lambda hf: _experts_read(hf, {"num_experts": 128, "num_experts_per_tok": 8,
                                  "norm_topk_prob": False, "router_aux_loss_coef": 0.001,
                                  "moe_intermediate_size": 768}),
    _qwen3_moe_written, options=("moe_layers", "norm_topk_prob"))


def _gemma4_experts_read(hf: dict[str, Any]) -> dict[str, Any]:
    """26B-A4B's experts (`enable_moe_block`), its dense MLP lathe's shared expert; none for
    the dense shapes. Its class renormalizes the top-k weights and computes no balance loss."""
    if not hf.get("enable_moe_block", False):
        return {}
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if not isinstance(hf.get(key), int) or isinstance(hf[key], bool) or hf[key] <= 0:
            raise ConfigError(f"config.json: enable_moe_block=true needs {key} (a positive "
                              f"integer), not {hf.get(key)!r}")
    return {"n_experts": hf["num_experts"], "n_experts_per_token": hf["top_k_experts"],
            "moe_ffn_hidden_dim": hf["moe_intermediate_size"],
            "shared_expert_dim": hf["intermediate_size"], "router_aux_loss_coef": 0.0}


def _gemma4_experts_written(config: Any) -> dict[str, Any]:
    moe = config.n_experts is not None
    return {"enable_moe_block": moe, "num_experts": config.n_experts,
            "top_k_experts": config.n_experts_per_token if moe else None,
            "moe_intermediate_size": config.moe_ffn_hidden_dim}


# Gemma 4 26B-A4B's MoE parameters: its class's names at the layer's level -> lathe's MoE
# block's (the MLP beside the experts is lathe's shared expert, each part with its own norm)
GEMMA4_RENAMES = (
    ("router.proj.weight", "mlp.gate.weight"), ("router.scale", "mlp.gate.scale"),
    ("router.per_expert_scale", "mlp.gate.per_expert_scale"),
    ("experts.gate_up_proj", "mlp.experts.gate_up_proj"),
    ("experts.down_proj", "mlp.experts.down_proj"),
    *((f"mlp.{part}.weight", f"mlp.shared_expert.{part}.weight") for part in STACKED),
    ("post_feedforward_layernorm_1.weight", "mlp.shared_expert_norm.weight"),
    ("pre_feedforward_layernorm_2.weight", "mlp.experts_input_norm.weight"),
    ("post_feedforward_layernorm_2.weight", "mlp.experts_norm.weight"))
GEMMA4_EXPERTS = ExpertLayout(
    "mlp", STACKED, _gemma4_experts_read, _gemma4_experts_written,
    options=("optional", "beside_mlp", "stacked", "shared_expert"), renames=GEMMA4_RENAMES)


def _qwen2_moe_read(hf: dict[str, Any]) -> dict[str, Any]:
    shared = hf.get("shared_expert_intermediate_size", 5632)
    return {**_experts_read(hf, {"num_experts": 60, "num_experts_per_tok": 4,
                                 "norm_topk_prob": False, "router_aux_loss_coef": 0.001,
                                 "moe_intermediate_size": 1408}),
            "shared_expert_dim": shared or None}


def _glm4_moe_read(hf: dict[str, Any]) -> dict[str, Any]:
    hf = {"n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
          "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
          "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
          **{k: v for k, v in hf.items() if v is not None}}
    for key in ("first_k_dense_replace", "n_shared_experts"):  # counts that build widths
        if not isinstance(hf[key], int) or isinstance(hf[key], bool) or hf[key] < 0:
            raise ConfigError(f"config.json: {key}={hf[key]!r} must be an integer >= 0")
    dense = hf["first_k_dense_replace"]
    layers = [int(i >= dense) for i in range(hf["num_hidden_layers"])]
    width = hf["moe_intermediate_size"]
    return {"n_experts": hf["n_routed_experts"], "n_experts_per_token": hf["num_experts_per_tok"],
            "moe_ffn_hidden_dim": width, "moe_layers": None if all(layers) else layers,
            "norm_topk_prob": bool(hf["norm_topk_prob"]), "router_aux_loss_coef": 0.0,
            "shared_expert_dim": hf["n_shared_experts"] * width or None,
            "n_expert_groups": hf["n_group"], "topk_expert_groups": hf["topk_group"],
            "routed_scaling_factor": hf["routed_scaling_factor"]}


def _glm4_moe_written(config: Any) -> dict[str, Any]:
    layers = config.moe_layers or [1] * config.n_layers
    return {"n_routed_experts": config.n_experts,
            "num_experts_per_tok": config.n_experts_per_token,
            "moe_intermediate_size": config.moe_ffn_hidden_dim,
            "n_shared_experts": (config.shared_expert_dim or 0) // config.moe_ffn_hidden_dim,
            "first_k_dense_replace": layers.count(0), "norm_topk_prob": config.norm_topk_prob,
            "n_group": config.n_expert_groups, "topk_group": config.topk_expert_groups,
            "routed_scaling_factor": config.routed_scaling_factor,
            "num_nextn_predict_layers": 0, "output_router_logits": False}


GLM4_MOE_EXPERTS = ExpertLayout(
    "mlp", STACKED, _glm4_moe_read, _glm4_moe_written,
    options=("moe_layers", "dense_first", "norm_topk_prob", "shared_expert", "shared_multiple",
             "mtp_layers"),
    shared="shared_experts")
QWEN2_MOE_EXPERTS = ExpertLayout(
    "mlp", STACKED, _qwen2_moe_read,
    lambda c: {**_qwen3_moe_written(c), "shared_expert_intermediate_size":
               c.shared_expert_dim or 0},
    options=("moe_layers", "norm_topk_prob", "shared_expert"))
def _qwen3_5_moe_read(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE's experts, in every layer, and its sigmoid-gated shared expert (Qwen3_5Moe-
    TextConfig's defaults); its class renormalizes the top-k weights."""
    hf = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
          "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001,
          **{k: v for k, v in hf.items() if v is not None}}
    # it has no dense MLP: a dense width equal to an expert's (what experts default to)
    dense = {} if hf.get("intermediate_size") else {"ffn_hidden_dim": hf["moe_intermediate_size"]}
    return {**_experts_read({**hf, "norm_topk_prob": True, "mlp_only_layers": None,
                             "decoder_sparse_step": 1}, {}),
            "shared_expert_dim": hf["shared_expert_intermediate_size"], **dense}


QWEN3_5_MOE_EXPERTS = ExpertLayout(
    "mlp", STACKED, _qwen3_5_moe_read,
    lambda c: {**_experts_written(c), "num_experts": c.n_experts,
               "moe_intermediate_size": c.moe_ffn_hidden_dim,
               "shared_expert_intermediate_size": c.shared_expert_dim},
    options=("shared_expert",))


def _qwen3_next_experts_read(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's experts (Qwen3NextConfig's defaults, 80B-A3B's: 512, ten a token, top-k
    renormalized) in the layers `mlp_only_layers` and `decoder_sparse_step` leave them, and
    its sigmoid-gated shared expert. Without experts its layers are Qwen3.5's: refused."""
    if hf.get("num_experts") == 0:
        raise ConfigError("config.json: num_experts=0 (a Qwen3-Next without experts) is not "
                          "supported; its layers are Qwen3.5's (model_type qwen3_5_text)")
    shared = hf.get("shared_expert_intermediate_size")
    return {**_experts_read(hf, {"num_experts": 512, "num_experts_per_tok": 10,
                                 "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
                                 "moe_intermediate_size": 512}),
            "shared_expert_dim": (512 if shared is None else shared) or None}


QWEN3_NEXT_EXPERTS = ExpertLayout(
    "mlp", STACKED, _qwen3_next_experts_read, QWEN2_MOE_EXPERTS.written,
    options=("moe_layers", "norm_topk_prob", "shared_expert"))
OLMOE_EXPERTS = ExpertLayout(
    "mlp", STACKED,
    lambda hf: _experts_read(hf, {"num_experts": 64, "num_experts_per_tok": 8,
                                  "norm_topk_prob": False, "router_aux_loss_coef": 0.01}),
    lambda c: {**_experts_written(c), "num_experts": c.n_experts,
               "norm_topk_prob": c.norm_topk_prob, "clip_qkv": c.clip_qkv},
    options=("norm_topk_prob",))


FAMILIES: dict[str, Family] = {
    "llama": Family(
        "LlamaForCausalLM", _attention_bias, _no_window,
        lambda c: {"attention_bias": c.qkv_bias, "mlp_bias": False, "pretraining_tp": 1}),
    "mistral": Family(
        "MistralForCausalLM", lambda hf: {}, _mistral_window,
        lambda c: {"sliding_window": c.sliding_window}, sliding="all"),
    "qwen2": Family(
        "Qwen2ForCausalLM", lambda hf: {"qkv_bias": True}, _qwen_window, _windows_written,
        sliding="layers"),
    "qwen3": Family(
        "Qwen3ForCausalLM", lambda hf: {"qk_norm": True, **_attention_bias(hf)}, _qwen_window,
        lambda c: {"attention_bias": c.qkv_bias, **_windows_written(c)}, sliding="layers"),
    "smollm3": Family(
        "SmolLM3ForCausalLM", _attention_bias, _smollm3_window,
        lambda c: {"attention_bias": c.qkv_bias, "mlp_bias": False,
                   "no_rope_layers": list(c.no_rope_layers or [1] * c.n_layers),
                   **_windows_written(c)}, sliding="layers", read=_smollm3_read),
    "phi3": Family(
        "Phi3ForCausalLM", lambda hf: {}, _mistral_window,
        lambda c: {"sliding_window": c.sliding_window, "partial_rotary_factor":
                   c.partial_rotary_factor, "original_max_position_embeddings":
                   c.rope_scaling.original_max_seq_len if c.rope_scaling is not None
                   and c.rope_scaling.rope_type == "longrope" else c.max_seq_len,
                   "resid_pdrop": 0.0, "embd_pdrop": 0.0},
        sliding="all", takes=("partial_rotary_factor",), fused=PHI3_FUSED, rope=_phi3_rope),
    "gemma2": Family(
        "Gemma2ForCausalLM", lambda hf: {**GEMMA, **_attention_bias(hf)}, _gemma_window(2),
        _gemma_extra, sliding="layers", takes=GEMMA_FIELDS),
    "gemma3_text": Family(
        "Gemma3ForCausalLM", lambda hf: {**GEMMA, "qk_norm": True, **_attention_bias(hf)},
        _gemma_window(6),
        lambda c: {**_gemma_extra(c), "rope_local_base_freq": c.rope_local_theta,
                   "use_bidirectional_attention": False},
        sliding="layers", takes=(*GEMMA_FIELDS, "rope_local_theta"),
        classifier_class="Gemma3TextForSequenceClassification",
        rope=_per_layer_type_rope(1_000_000.0), read=_sliding_rope_read(10000.0)),
    "gemma4_text": Family(
        "Gemma4ForCausalLM", lambda hf: {**GEMMA4, **_attention_bias(hf)}, _gemma4_window,
        _gemma4_extra, sliding="layers", takes=GEMMA4_FIELDS, experts=GEMMA4_EXPERTS,
        classifier_class="", rope=_gemma4_rope, read=_gemma4_read),
    "qwen3_5_text": Family(
        "Qwen3_5ForCausalLM", _qwen3_5_switches, _qwen3_5_layers, _qwen3_5_extra,
        takes=QWEN3_5_TAKES, classifier_class="Qwen3_5TextForSequenceClassification",
        read=_qwen3_5_read),
    "qwen3_5_moe_text": Family(
        "Qwen3_5MoeForCausalLM", lambda hf: {**_qwen3_5_switches(hf), "shared_expert_gate": True},
        _qwen3_5_layers, lambda c: {**_qwen3_5_extra(c), **QWEN3_5_MOE_EXPERTS.written(c)},
        takes=QWEN3_5_TAKES, experts=QWEN3_5_MOE_EXPERTS, classifier_class="",
        read=_qwen3_5_read),
    "qwen3_next": Family(
        "Qwen3NextForCausalLM",
        lambda hf: {**_qwen3_5_switches(hf), "shared_expert_gate": True}, _qwen3_5_layers,
        lambda c: {**_qwen3_5_extra(c), **QWEN3_NEXT_EXPERTS.written(c)},
        takes=QWEN3_5_TAKES, fused=QWEN3_NEXT_FUSED, experts=QWEN3_NEXT_EXPERTS,
        read=_qwen3_5_read),
    "mixtral": Family(
        "MixtralForCausalLM", lambda hf: {}, _mistral_window,
        lambda c: {"sliding_window": c.sliding_window, **MIXTRAL_EXPERTS.written(c)},
        sliding="all", experts=MIXTRAL_EXPERTS),
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM", lambda hf: {"qk_norm": True, **_attention_bias(hf)},
        _qwen_window,
        lambda c: {"attention_bias": c.qkv_bias, **_windows_written(c),
                   **QWEN3_MOE_EXPERTS.written(c)},
        sliding="layers", experts=QWEN3_MOE_EXPERTS),
    "qwen2_moe": Family(
        "Qwen2MoeForCausalLM",
        lambda hf: {"qkv_bias": bool(hf.get("qkv_bias", hf.get("attention_bias", True))),
                    "shared_expert_gate": True},
        _qwen_window,
        lambda c: {"qkv_bias": c.qkv_bias, **_windows_written(c), **QWEN2_MOE_EXPERTS.written(c)},
        sliding="layers", experts=QWEN2_MOE_EXPERTS),
    "glm4_moe": Family(
        "Glm4MoeForCausalLM",
        lambda hf: {"qkv_bias": bool(hf.get("attention_bias", False)), "sigmoid_router": True,
                    "qk_norm": bool(hf.get("use_qk_norm", False))},
        _no_window,
        lambda c: {"attention_bias": c.qkv_bias, "use_qk_norm": c.qk_norm,
                   "partial_rotary_factor": c.partial_rotary_factor, **GLM4_MOE_EXPERTS.written(c)},
        takes=("partial_rotary_factor",), experts=GLM4_MOE_EXPERTS, classifier_class=""),
    "olmo2": Family(
        "Olmo2ForCausalLM", lambda hf: {**OLMO2, **_attention_bias(hf)}, _no_window,
        lambda c: {"attention_bias": c.qkv_bias}),
    "olmo3": Family(
        "Olmo3ForCausalLM", lambda hf: {**OLMO2, **_attention_bias(hf)}, _olmo3_window,
        _olmo3_extra, sliding="layers", takes=("rope_local_theta",),
        rope=_per_layer_type_rope(500_000.0), read=_sliding_rope_read(None)),
    "olmoe": Family(
        "OlmoeForCausalLM", lambda hf: {"qk_norm_projection": True, **_attention_bias(hf)},
        _no_window, lambda c: {"attention_bias": c.qkv_bias, **OLMOE_EXPERTS.written(c)},
        takes=("clip_qkv",), experts=OLMOE_EXPERTS, classifier_class=""),
}


@dataclass(frozen=True)
class Wrapper:
    """A multimodal checkpoint whose language model is a family's."""

    language_model: str  # the family's model_type
    # the wrapper's default text_config, which transformers writes a text_config as the
    # difference from (4.x's nested configs; the hub's checkpoints): a key left out is this
    text_defaults: dict[str, Any]
    # its RoPE base, where the text_config names none (at the top, 4.x, or among its
    # rope_parameters, 5.x)
    rope_theta: float | None = None


# their text_config is read as that family's config.json, and a load keeps the language
# model's weights alone (`language_model_weights`); an export is the text model, as the
# family's. Gemma 3 from 4B up (Gemma3TextConfig's defaults; its RoPE bases and window
# default in `_gemma3_rope`, `_gemma3_read` and `_gemma_window`); Gemma 4 (Gemma4Config's,
# its image and audio towers left out); Mistral Small 3.1 and 3.2 (Mistral3Config's
# text_config)
WRAPPERS = {
    "gemma3": Wrapper("gemma3_text", {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True}),
    "gemma4": Wrapper("gemma4_text", {
        "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "sliding_window": 512,
        "hidden_size_per_layer_input": 256, "tie_word_embeddings": True}),
    "mistral3": Wrapper("mistral", {
        "vocab_size": 131_072, "hidden_size": 5120, "intermediate_size": 32_768,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-5, "sliding_window": None, "tie_word_embeddings": False},
        rope_theta=1e9),
    "qwen3_5": Wrapper("qwen3_5_text", {
        "vocab_size": 248_320, "hidden_size": 4096, "intermediate_size": 12_288,
        "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 32_768,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0,
                            "partial_rotary_factor": 0.25}}),
    "qwen3_5_moe": Wrapper("qwen3_5_moe_text", {
        "vocab_size": 248_320, "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "hidden_act": "silu", "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0,
                            "partial_rotary_factor": 0.25}}),
}
WRAPPER_PREFIXES = ("language_model.model.", "model.language_model.")  # 4.x's, 5.x's
WRAPPER_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                 "model.multi_modal_projector.", "model.embed_vision.", "model.audio_tower.",
                 "model.embed_audio.",  # Gemma 4's embedders of image and audio features
                 "model.visual.")  # Qwen3.5's vision tower
# multi-token-prediction heads beside the model (Qwen3.5's `mtp.`), which its class ignores
IGNORED_PREFIXES = ("mtp.",)


def language_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf`, or a multimodal wrapper's (`WRAPPERS`) text_config as a config of its own."""
    wrapper = WRAPPERS.get(hf.get("model_type"))
    if wrapper is None:
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: model_type={hf['model_type']!r} needs its language "
                          f"model's settings as an object in text_config, not {text!r}")
    config = {**wrapper.text_defaults, **text, "model_type": wrapper.language_model}
    if hf.get("tie_word_embeddings") is not None:  # transformers 5 ties by the wrapper's
        config["tie_word_embeddings"] = hf["tie_word_embeddings"]
    rope = config.get("rope_parameters")
    if wrapper.rope_theta is not None and config.get("rope_theta") is None and not (
            isinstance(rope, dict) and rope.get("rope_theta") is not None):
        config["rope_theta"] = wrapper.rope_theta
    return config


def language_model_weights(state: dict[str, Any]) -> dict[str, Any]:
    """A multimodal wrapper's state dict as its language model's (`model.`, `lm_head.`
    names), without the vision tower and projector; any other state dict as it is."""
    if not any(name.startswith(WRAPPER_PREFIXES + ("language_model.lm_head.",))
               for name in state):
        return state
    out = {}
    for name, tensor in state.items():
        if name.startswith(WRAPPER_PARTS):
            continue
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name.removeprefix(prefix)
                break
        out[name.removeprefix("language_model.")] = tensor
    return out


SWITCHES = ("qkv_bias", "o_bias", "qk_norm", "norm_unit_offset", "sandwich_norms", "embed_scale",
            "qk_norm_projection", "post_norms", "shared_expert_gate", "sigmoid_router", "v_norm",
            "layer_scalar", "attn_output_gate")


def family_switches(model_type: str, config: Any) -> dict[str, bool]:
    """The switch values `model_type`'s own class builds for `config`'s bias setting
    (what a `ModelConfig` of that family must hold for its export to load back)."""
    hf = {"attention_bias": config.qkv_bias, "use_qk_norm": config.qk_norm}
    return {name: False for name in SWITCHES} | FAMILIES[model_type].switches(hf)


def _parts(config: Any, fused: str) -> list[int]:
    """The output widths of the projections `fused` stacks."""
    kv = config.n_kv_heads * config.head_dim
    if fused.endswith("in_proj_qkvz"):
        return [config.linear_conv_channels,
                config.linear_value_heads * config.linear_value_head_dim]
    if fused.endswith("in_proj_ba"):
        return [config.linear_value_heads] * 2
    return [config.q_dim, kv, kv] if fused.endswith("qkv_proj") else [config.ffn_hidden_dim] * 2


def fused_rows(config: Any, fused: str) -> torch.Tensor | None:
    """The fused projection's row of each row of lathe's parts, stacked in order, where its
    family interleaves them (Qwen3-Next's Gated DeltaNet: each key head's q, k, and its group
    of value heads' v and z rows, then the next key head's; its b and a rows likewise, where
    lathe holds all q, k and v rows, then z's); None where the parts are stacked whole."""
    if not fused.startswith("linear_attn."):
        return None
    heads = config.linear_key_heads
    group = config.linear_value_heads // heads
    key, value = config.linear_key_head_dim, config.linear_value_head_dim
    pieces = [key, key, group * value, group * value] if fused.endswith("qkvz") \
        else [group, group]
    by_head = torch.arange(heads * sum(pieces)).view(heads, sum(pieces)).split(pieces, dim=1)
    return torch.cat([piece.reshape(-1) for piece in by_head])


SHARED_KV_PARTS = ("k_proj.", "v_proj.", "k_norm.", "v_norm.")


def drop_shared_kv(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """`state` without the key and value weights of the layers that share another's (Gemma 4
    E2B, E4B): a checkpoint may hold them, and transformers ignores them as lathe does."""
    if not config.kv_shared_layers:
        return state
    dropped = tuple(f"model.layers.{i}.self_attn.{part}" for part in SHARED_KV_PARTS
                    for i in range(config.n_layers - config.kv_shared_layers, config.n_layers))
    return {name: tensor for name, tensor in state.items() if not name.startswith(dropped)}


def split_fused(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """A checkpoint's state dict with its family's fused projections split into lathe's."""
    out = {}
    for name, tensor in state.items():
        fused = next((f for f in FAMILIES[config.family].fused if f".{f}." in name), None)
        if fused is None or tensor.shape[0] != sum(_parts(config, fused)):
            out[name] = tensor  # a mis-shaped one is reported by the shape check
            continue
        rows = fused_rows(config, fused)
        if rows is not None:
            tensor = tensor[rows]
        for part, piece in zip(FUSED[fused], tensor.split(_parts(config, fused)), strict=True):
            out[name.replace(fused, part)] = piece
    return out


def join_fused(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """lathe's state dict with the projections its family stores fused joined again."""
    out = dict(state)
    for fused in FAMILIES[config.family].fused:
        first = FUSED[fused][0]
        for name in [n for n in state if f".{first}." in n]:
            names = [name.replace(first, part) for part in FUSED[fused]]
            joined = torch.cat([out.pop(n) for n in names])
            rows = fused_rows(config, fused)
            out[name.replace(first, fused)] = joined if rows is None \
                else joined[torch.argsort(rows)]
    return out


def _expert_names(layout: ExpertLayout, name: str) -> tuple[str, int, int] | None:
    """A per-expert checkpoint key -> (its layer's prefix, expert, projection index)."""
    marker = f".{layout.block}.experts."
    if marker not in name:
        return None
    prefix, rest = name.split(marker, 1)
    expert, _, projection = rest.partition(".")
    projection = projection.removesuffix(".weight")
    if not expert.isdigit() or projection not in layout.projections:
        return None
    return prefix, int(expert), layout.projections.index(projection)


def _layer_parts(name: str) -> tuple[str, str, str] | None:
    """`<head>.layers.<N>.<rest>` as (head, N, rest); None for a name outside the layers."""
    head, found, part = name.partition(".layers.")
    index, _, rest = part.partition(".")
    return (head, index, rest) if found else None


def _renamed(name: str, names: dict[str, str]) -> str:
    """`model.layers.N.<part>` as `model.layers.N.<names[part]>`; other names as they are."""
    parts = _layer_parts(name)
    if parts is None or parts[2] not in names:
        return name
    head, index, rest = parts
    return f"{head}.layers.{index}.{names[rest]}"


def adapter_renamed(weights: dict[str, Any], config: Any,
                    to_checkpoint: bool = False) -> dict[str, Any]:
    """LoRA weights (`…layers.N.<module>.lora_A.weight`, …) of a family whose class keeps MoE
    parts outside its MLP block (Gemma 4) under lathe's module names, or (`to_checkpoint`)
    its class's, so that peft loads lathe's adapter on that class and lathe a class's; other
    families' as they are."""
    layout = FAMILIES[config.family].experts
    if layout is None or config.n_experts is None or not layout.renames:
        return weights
    # what adapters attach to: the renamed linears, and the stacked experts' module
    modules = {name.rpartition(".")[0]: ours.rpartition(".")[0] for name, ours in layout.renames
               if name.endswith(".weight") or ours.startswith(f"{layout.block}.experts.")}
    if to_checkpoint:
        modules = {ours: name for name, ours in modules.items()}
    longest_first = sorted(modules, key=len, reverse=True)
    out = {}
    for name, tensor in weights.items():
        parts = _layer_parts(name)
        module = None if parts is None else next(
            (m for m in longest_first if parts[2].startswith(f"{m}.")), None)
        if module is not None:
            head, index, rest = parts
            name = f"{head}.layers.{index}.{modules[module]}{rest[len(module):]}"
        out[name] = tensor
    return out


def stack_experts(state: dict[str, Any], config: Any, per_row: bool = False) -> dict[str, Any]:
    """A checkpoint's state dict with per-expert tensors stacked into lathe's layout (and
    Mixtral's `block_sparse_moe` router named `mlp.gate`, Gemma 4's parameters renamed into
    the MoE block); one already stacked passes. A missing or mis-shaped expert tensor is a
    CheckpointError naming it (`per_row`: tensors of one value per row or per group of a row,
    whose rows alone are checked)."""
    layout = FAMILIES[config.family].experts
    if layout is None or config.n_experts is None:
        return state
    out, pieces, renames = {}, {}, dict(layout.renames)
    for name, tensor in state.items():
        if "mtp_layers" in layout.options and _layer_index(name) >= config.n_layers:
            continue
        name = _renamed(name, renames)
        found = _expert_names(layout, name)
        if found is None:
            name = name.replace(f".{layout.block}.gate.", ".mlp.gate.")
            out[name.replace(f".mlp.{layout.shared}.", ".mlp.shared_expert.")] = tensor
        else:
            pieces.setdefault(found[0], {})[found[1:]] = tensor
    for prefix, tensors in pieces.items():
        width = config.moe_ffn_hidden_dim
        shapes = [(width, config.dim), (width, config.dim), (config.dim, width)]
        for expert in range(config.n_experts):
            for index, shape in enumerate(shapes):
                key = f"{prefix}.{layout.block}.experts.{expert}.{layout.projections[index]}" \
                      ".weight"
                tensor = tensors.get((expert, index))
                if tensor is None:
                    raise CheckpointError(f"{key} is missing: every one of the {config.n_experts}"
                                          " experts needs its gate, up and down projections")
                if (tensor.shape[:1] != shape[:1]) if per_row else tuple(tensor.shape) != shape:
                    raise CheckpointError(f"{key} has shape {tuple(tensor.shape)}, expected "
                                          f"{shape}")
        if len(tensors) != 3 * config.n_experts:
            extra = sorted(e for e, _ in tensors if e >= config.n_experts)
            raise CheckpointError(f"{prefix}.{layout.block}.experts.{extra[0]}: expert past "
                                  f"n_experts={config.n_experts}")
        stacked = [torch.stack([tensors[(e, i)] for e in range(config.n_experts)])
                   for i in range(3)]
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat(stacked[:2], dim=1)
        out[f"{prefix}.mlp.experts.down_proj"] = stacked[2]
    return out


def unstack_experts(state: dict[str, Any], config: Any) -> dict[str, Any]:
    """lathe's state dict in its family's per-expert layout (or, for a class that keeps them
    stacked, under its names), as its class saves it."""
    layout = FAMILIES[config.family].experts
    if layout is None or config.n_experts is None:
        return state
    if "stacked" in layout.options:
        saved = {lathe: name for name, lathe in layout.renames}
        return {_renamed(name, saved): tensor for name, tensor in state.items()}
    out = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".mlp.experts.gate_up_proj")
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1), strict=True)):
                for index, piece in ((0, gate), (1, up)):
                    out[f"{prefix}.{layout.block}.experts.{e}.{layout.projections[index]}"
                        ".weight"] = piece.clone()  # safetensors refuses views of one tensor
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".mlp.experts.down_proj")
            for e, down in enumerate(tensor):
                out[f"{prefix}.{layout.block}.experts.{e}.{layout.projections[2]}.weight"] = \
                    down.clone()
        else:
            name = name.replace(".mlp.shared_expert.", f".mlp.{layout.shared}.")
            out[name.replace(".mlp.gate.", f".{layout.block}.gate.")] = tensor
    return out


def _layer_index(name: str) -> int:
    """The layer a `model.layers.N.` key belongs to; -1 for the others."""
    if not name.startswith("model.layers."):
        return -1
    index = name.split(".")[2]
    return int(index) if index.isdigit() else -1


def fresh_switches(family: str, n_layers: int, head_dim: int,
                   expert_width: int | None = None, n_heads: int = 1) -> dict[str, Any]:
    """What a new model of `family` sets beyond the Llama shape (`lathe init --family`,
    pretraining from scratch), as the family's transformers config class defaults: its
    switches, Gemma's activation, caps, query scale and alternating sliding layers (Gemma 4's
    wider full layers and their proportional RoPE), OLMo 3's sliding layers, and a
    mixture of experts' 8 experts, 2 per token, of the dense MLP's width (top-k weights
    renormalized but for OLMoE, as Qwen3-30B-A3B and OLMoE-1B-7B do; GLM-4.5's sigmoid router
    without a balance loss, as its class has none), and for a family with a shared expert
    (Qwen2-MoE, GLM-4.5) one of the experts' `expert_width`, which transformers' classes
    always build. Qwen3.5's: three Gated DeltaNet layers in each four, as many key heads as
    the `n_heads` query heads and twice as many value heads, each half a head wide (its
    9B's proportions), and a quarter of each attention head turned by RoPE."""
    if family not in FAMILIES:
        raise ConfigError(f"family={family!r} is not one lathe takes; choose one of "
                          f"{', '.join(FAMILIES)}")
    switches = {name: value for name, value in
                FAMILIES[family].switches({"attention_bias": False}).items() if value}
    if "linear_key_heads" in FAMILIES[family].takes:  # Qwen3.5's (dense or not), Qwen3-Next's
        width = max(head_dim // 2, 2)
        switches = {**switches, "partial_rotary_factor": 0.25,
                    "layer_types": _qwen3_5_layers({"num_hidden_layers": n_layers})[1],
                    "linear_key_heads": n_heads, "linear_value_heads": 2 * n_heads,
                    "linear_key_head_dim": width, "linear_value_head_dim": width}
    experts = FAMILIES[family].experts
    if experts is not None and "optional" not in experts.options:
        sigmoid = {"router_aux_loss_coef": 0.0} if switches.get("sigmoid_router") else {}
        # transformers' class always builds the shared expert of a family that has one
        shared = {"shared_expert_dim": expert_width} if "shared_expert" in experts.options \
            else {}
        return {**switches, "n_experts": 8, "n_experts_per_token": 2,
                "norm_topk_prob": family != "olmoe", **sigmoid, **shared}
    if family == "olmo3":  # OLMo 3's: three sliding layers of each four, one RoPE base
        return {**switches, "sliding_window": 4096, "rope_theta": 500_000.0,
                "rope_local_theta": 500_000.0,
                "layer_types": ["sliding_attention" if (i + 1) % 4 else "full_attention"
                                for i in range(n_layers)]}
    if family == "gemma4_text":  # its config class's: heads twice as wide in the full layers
        return {**switches, "hidden_act": "gelu_pytorch_tanh", "sliding_window": 512,
                "layer_types": _gemma4_window({"num_hidden_layers": n_layers})[1],
                "rope_theta": 1_000_000.0, "rope_local_theta": 10_000.0,
                "rope_proportion": 0.25, "global_head_dim": 2 * head_dim}
    if family not in ("gemma2", "gemma3_text"):
        return switches
    every = 2 if family == "gemma2" else 6
    gemma = {"hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": head_dim,
             "sliding_window": 4096 if family == "gemma2" else 512,
             "layer_types": ["sliding_attention" if (i + 1) % every else "full_attention"
                             for i in range(n_layers)]}
    if family == "gemma2":
        return {**switches, **gemma, "attn_softcap": 50.0, "final_softcap": 30.0}
    return {**switches, **gemma, "rope_theta": 1_000_000.0, "rope_local_theta": 10_000.0}
