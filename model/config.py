"""The model's shape: `ModelConfig`, its named presets, and its Hugging Face `config.json`
form for each family lathe takes (`lathe.model.families`).

Everything that describes the architecture lives here, so that the transformer, the
checkpoint writer, the FLOP counter and (later) the GGUF exporter all read one object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lathe.core.config import from_dict
from lathe.core.errors import ConfigError
from lathe.model.families import (
    FAMILIES,
    LINEAR_FIELDS,
    WRAPPERS,
    family_switches,
    fresh_switches,
    language_model_config,
)

ROPE_TYPES = ("llama3", "linear", "yarn", "longrope", "dynamic")
LAYER_TYPES = ("sliding_attention", "full_attention", "linear_attention")
ATTENTION_TYPES = LAYER_TYPES[:2]  # the layers that attend (and keep keys and values)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # HF's names for the gated MLP's activation


@dataclass
class RopeScaling:
    """RoPE scaling as HF configs name it (`rope_type`):

    - "llama3": Llama 3's frequency-dependent division by `factor` (`low_freq_factor`,
      `high_freq_factor` around `original_max_seq_len`);
    - "linear": position interpolation, every frequency divided by `factor`;
    - "yarn": YaRN (Qwen2.5's long context): frequencies ramp from interpolated to
      extrapolated between the dimensions that turn `beta_slow` and `beta_fast` times over
      `original_max_seq_len`, and cos/sin are scaled by `attention_factor` (by default
      0.1 ln(factor) + 1, or the ratio of `mscale` to `mscale_all_dim` versions of it);
    - "longrope": LongRoPE (Phi-3.5, Phi-4-mini): each frequency divided by its own factor,
      `short_factor` while a forward's positions stay within `original_max_seq_len`,
      `long_factor` once one passes it (transformers' rule: per forward, whole), and cos/sin
      scaled by `attention_factor` (by default sqrt(1 + ln(factor) / ln(original)));
    - "dynamic": dynamic NTK — once a forward's positions pass `original_max_seq_len` (the
      HF config's `max_position_embeddings`), the base becomes
      theta · (factor · L / original − (factor − 1))^(d / (d − 2)) for L the forward's
      largest position + 1 (transformers' rule for a fresh model; one that ran a longer
      forward keeps that base until a forward falls back within `original`, where lathe
      derives it from each forward alone; keys cached by earlier forwards keep the base they
      were rotated with, as in transformers). The model's context is `original` × `factor`
      (as vLLM serves it); exports write `original` back.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: list[float] | None = None
    long_factor: list[float] | None = None

    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (YaRN's and LongRoPE's attention factor; 1
        otherwise)."""
        if self.rope_type not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.rope_type == "longrope":
            return 1.0 if self.factor <= 1 else math.sqrt(
                1 + math.log(self.factor) / math.log(self.original_max_seq_len))

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)


@dataclass
class ModelConfig:
    """A decoder-only transformer: Llama's architecture and the switches by which other
    open-model families differ from it.

    `ffn_hidden_dim` left as None is derived the Llama way: 8/3 * dim, times
    `ffn_dim_multiplier` when set, rounded up to a multiple of `multiple_of`.
    `n_kv_heads` left as None means multi-head attention (one KV head per query head);
    fewer KV heads give grouped-query attention, a single one multi-query attention.
    `head_dim` left as None is dim / n_heads (Qwen3 sets it apart).
    `family` is the HF `model_type` a checkpoint is written as; its switches must be
    what that family's transformers class builds: `qkv_bias` (bias on q, k, v), `o_bias`
    (on the output projection), `qk_norm` (an RMSNorm over each head of q and k),
    `no_rope_layers` (SmolLM3's layers without positional rotation, "NoPE").
    `sliding_window` makes attention local: a token sees itself and the `sliding_window - 1`
    before it; `layer_types` (HF's per-layer "sliding_attention" / "full_attention") says
    which layers slide, every one when it is None.
    Gemma's switches: `norm_unit_offset` (norms scale by 1 + weight, weights start at 0),
    `sandwich_norms` (a norm after attention and after the MLP too, before each residual
    add), `embed_scale` (embeddings times √dim), `hidden_act` ("gelu_pytorch_tanh" in the
    gated MLP), `query_pre_attn_scalar` (scores scaled by its -½ power, not head_dim's),
    `attn_softcap` and `final_softcap` (scores, logits -> cap·tanh(x / cap)), and
    `rope_local_theta` (Gemma 3: the sliding layers' RoPE base, unscaled).
    `qk_norm_projection` (OLMoE, OLMo 2 and 3): one RMSNorm over the whole q and k
    projections, not per head; `clip_qkv` clamps q, k and v to ±clip_qkv. `post_norms`
    (OLMo 2 and 3): no norm before attention or the MLP; each one's output is normed before
    its residual add (`post_attention_layernorm`, `post_feedforward_layernorm`).
    Mixture of experts (`n_experts` set): a layer's MLP is a router (a softmax over the
    experts, the top `n_experts_per_token` taken, their weights renormalized to sum 1 when
    `norm_topk_prob`) and `n_experts` gated MLPs of `moe_ffn_hidden_dim` (default
    `ffn_hidden_dim`); `moe_layers` (1 MoE, 0 dense per layer; None: every layer) leaves some
    layers a dense MLP of `ffn_hidden_dim`; `shared_expert_dim` adds an MLP every token goes
    through, scaled by a sigmoid gate when `shared_expert_gate` (Qwen2-MoE; GLM-4.5's is
    ungated). `sigmoid_router` (GLM-4.5 MoE; DeepSeek-V3's routing): the experts are scored by
    a sigmoid, not a softmax, and chosen by score plus a per-expert selection bias (the
    router's `e_score_correction_bias`, which pretraining's aux-loss-free balancing moves) —
    only among the `topk_expert_groups` best of `n_expert_groups` groups of experts — and
    weighted by their unbiased scores (renormalized when `norm_topk_prob`) times
    `routed_scaling_factor`. Training adds `router_aux_loss_coef` times the Switch Transformer
    load-balancing loss when `router_aux_loss` (as transformers computes it, and adds it only
    with `output_router_logits`, which a hub checkpoint's config.json mostly leaves false; a
    sigmoid router's family has none) and `router_z_loss_coef` times ST-MoE's router z-loss.
    Gemma 4's: its full-attention layers have heads of their own width `global_head_dim`
    and `global_n_kv_heads` KV heads, whose values are their keys' projection when
    `global_k_is_v` (no `v_proj`), and turn by "proportional" RoPE (`rope_proportion`: the
    first share of each half-head's frequencies, computed over the whole head width, the rest
    not turning); `v_norm` normalizes each head of v (an RMSNorm without weight), and
    `layer_scalar` multiplies each layer's output by a stored scalar (a buffer, not trained).
    Gemma 4 E2B and E4B: `per_layer_dim` > 0 gives each layer an input of its own (per-layer
    embeddings: a token's row of a (vocab, n_layers · per_layer_dim) table plus a projection
    of its embedding, gating a residual branch after the MLP); the last `kv_shared_layers`
    layers compute no keys or values but attend over those of the last earlier layer of their
    kind (`kv_source`), whose MLPs are twice as wide when `double_wide_shared_mlp`. Gemma 4
    26B-A4B: experts beside every layer's MLP (`experts_beside_mlp`, the family's with
    `n_experts` set), that MLP lathe's shared expert.
    Qwen3.5's: `layer_types` "linear_attention" marks Gated DeltaNet layers (linear attention
    with a recurrent state, `lathe.model.gated_delta_net`) of `linear_key_heads` query/key
    heads of `linear_key_head_dim` and `linear_value_heads` value heads of
    `linear_value_head_dim`, after a causal convolution `linear_conv_kernel` wide; its
    attention layers gate their output by a sigmoid of a second half of q_proj
    (`attn_output_gate`).
    `num_labels` > 0 makes the model a sequence classifier (a reward model: HF's
    `…ForSequenceClassification`): a `score` head of that many outputs in place of the LM
    head, read at each sequence's last token.
    """

    vocab_size: int = 2048
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden_dim: int | None = None
    multiple_of: int = 32
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 256
    tie_embeddings: bool = True
    init_std: float = 0.02
    head_dim: int | None = None
    family: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    no_rope_layers: list[int] | None = None  # SmolLM3: per layer, 1 rotates q and k, 0 not
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_local_theta: float | None = None
    partial_rotary_factor: float = 1.0  # the share of each head's channels RoPE rotates
    qk_norm_projection: bool = False
    clip_qkv: float | None = None
    post_norms: bool = False
    n_experts: int | None = None
    n_experts_per_token: int = 2
    moe_ffn_hidden_dim: int | None = None
    moe_layers: list[int] | None = None
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    router_aux_loss: bool = True  # whether training adds it (transformers' output_router_logits)
    router_z_loss_coef: float = 0.0
    shared_expert_dim: int | None = None
    shared_expert_gate: bool = False
    sigmoid_router: bool = False
    n_expert_groups: int = 1
    topk_expert_groups: int = 1
    routed_scaling_factor: float = 1.0
    global_head_dim: int | None = None
    global_n_kv_heads: int | None = None
    global_k_is_v: bool = False
    rope_proportion: float | None = None
    v_norm: bool = False
    layer_scalar: bool = False
    per_layer_dim: int = 0
    kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    attn_output_gate: bool = False
    num_labels: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.family not in FAMILIES:
            raise ConfigError(f"ModelConfig.family={self.family!r} is not one lathe takes; "
                              f"choose one of {', '.join(FAMILIES)}")
        wanted = family_switches(self.family, self)
        wrong = {name: getattr(self, name) for name in wanted
                 if getattr(self, name) != wanted[name]}
        if wrong:
            raise ConfigError(f"ModelConfig: family={self.family!r} builds "
                              + ", ".join(f"{n}={wanted[n]}" for n in wrong) + ", not "
                              + ", ".join(f"{n}={v}" for n, v in wrong.items()))
        if self.no_rope_layers is not None and self.family != "smollm3":
            raise ConfigError(f"ModelConfig.no_rope_layers is SmolLM3's; family={self.family!r} "
                              "rotates every layer (set family: smollm3 or drop it)")
        explicit_head_dim = self.head_dim is not None
        if not explicit_head_dim and isinstance(self.dim, int) and isinstance(self.n_heads, int) \
                and self.n_heads > 0:
            self.head_dim = self.dim // self.n_heads
        self._validate_shape(explicit_head_dim)
        layers = self.no_rope_layers
        if layers is not None and (len(layers) != self.n_layers
                                   or any(flag not in (0, 1) for flag in layers)):
            raise ConfigError(f"ModelConfig.no_rope_layers={layers!r} must hold a 0 or 1 for "
                              f"each of the {self.n_layers} layers")
        self._validate_window()
        if self.ffn_hidden_dim is None:
            self.ffn_hidden_dim = llama_ffn_hidden_dim(
                self.dim, self.multiple_of, self.ffn_dim_multiplier
            )
        self._validate_rest()
        self._validate_global_layers()
        self._validate_shared_layers()
        self._validate_linear_layers()
        self._validate_experts()
        self._validate_sigmoid_router()

    def _validate_experts(self) -> None:
        takes = FAMILIES[self.family].takes
        if self.clip_qkv is not None and ("clip_qkv" not in takes or not isinstance(
                self.clip_qkv, (int, float)) or self.clip_qkv <= 0):
            raise ConfigError(f"ModelConfig.clip_qkv={self.clip_qkv!r}: a positive number for "
                              f"a family that clips (olmoe), or null; family={self.family!r}")
        experts = FAMILIES[self.family].experts
        if self.n_experts is None:
            if experts is not None and "optional" not in experts.options:
                raise ConfigError(f"ModelConfig: family={self.family!r} is a mixture of experts;"
                                  " set n_experts (and n_experts_per_token)")
            if self.moe_layers is not None or self.moe_ffn_hidden_dim is not None \
                    or self.shared_expert_dim is not None:
                raise ConfigError("ModelConfig: moe_layers, moe_ffn_hidden_dim and "
                                  "shared_expert_dim need n_experts (a mixture-of-experts "
                                  "family)")
            return
        if experts is None:
            raise ConfigError(f"ModelConfig.n_experts={self.n_experts!r}: family="
                              f"{self.family!r} is dense; choose one of "
                              + ", ".join(n for n, f in FAMILIES.items() if f.experts))
        for name in ("n_experts", "n_experts_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{name}={value!r} must be a positive integer")
        if self.n_experts_per_token > self.n_experts:
            raise ConfigError(f"ModelConfig.n_experts_per_token={self.n_experts_per_token} "
                              f"exceeds n_experts={self.n_experts}")
        if self.moe_ffn_hidden_dim is None:
            self.moe_ffn_hidden_dim = self.ffn_hidden_dim
        if not isinstance(self.moe_ffn_hidden_dim, int) or self.moe_ffn_hidden_dim <= 0:
            raise ConfigError(f"ModelConfig.moe_ffn_hidden_dim={self.moe_ffn_hidden_dim!r} "
                              "must be a positive integer")
        layers = self.moe_layers
        if layers is not None and (len(layers) != self.n_layers
                                   or any(flag not in (0, 1) for flag in layers)):
            raise ConfigError(f"ModelConfig.moe_layers={layers!r} must hold a 0 (dense) or 1 "
                              f"(mixture of experts) for each of the {self.n_layers} layers")
        if layers is not None and "moe_layers" not in experts.options:
            raise ConfigError(f"ModelConfig.moe_layers: family={self.family!r} has experts in "
                              "every layer; drop moe_layers (qwen3_moe can mix)")
        shared = self.shared_expert_dim
        if shared is not None and ("shared_expert" not in experts.options
                                   or not isinstance(shared, int) or shared <= 0):
            raise ConfigError(f"ModelConfig.shared_expert_dim={shared!r}: a positive width for "
                              f"a family with a shared expert (qwen2_moe, glm4_moe); family="
                              f"{self.family!r}")
        if layers is not None and "dense_first" in experts.options \
                and layers != sorted(layers):
            raise ConfigError(f"ModelConfig.moe_layers={layers!r}: family={self.family!r} "
                              "makes its first layers dense and the rest experts "
                              "(first_k_dense_replace): put the 0s first")
        if shared is not None and "shared_multiple" in experts.options \
                and shared % self.moe_ffn_hidden_dim:
            raise ConfigError(f"ModelConfig.shared_expert_dim={shared}: family={self.family!r}'s "
                              "shared MLP is n_shared_experts experts wide, a multiple of "
                              f"moe_ffn_hidden_dim={self.moe_ffn_hidden_dim}")
        if self.experts_beside_mlp:
            self._validate_beside_mlp()
        if not self.norm_topk_prob and "norm_topk_prob" not in experts.options:
            raise ConfigError(f"ModelConfig.norm_topk_prob=false: family={self.family!r} "
                              "always renormalizes its top-k weights")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"ModelConfig.{name}={value!r} must be a number >= 0")

    def _validate_beside_mlp(self) -> None:
        if self.shared_expert_dim is None:
            self.shared_expert_dim = self.ffn_hidden_dim
        if self.shared_expert_dim != self.ffn_hidden_dim:
            raise ConfigError(f"ModelConfig.shared_expert_dim={self.shared_expert_dim!r}: "
                              f"family={self.family!r}'s MLP beside the experts is its "
                              f"ffn_hidden_dim={self.ffn_hidden_dim} wide; drop it")
        if self.double_wide_shared_mlp:
            raise ConfigError("ModelConfig.double_wide_shared_mlp: Gemma 4's MLPs beside "
                              "experts are not doubled (no Gemma 4 shape has both); drop it")

    @property
    def experts_beside_mlp(self) -> bool:
        """Gemma 4 26B-A4B's layers: experts beside the MLP (the shared expert), each part
        normed after on its own and their sum normed again; the experts read the layer's
        residual through their own input norm, and the router its weightless RMSNorm times
        a learned scale and dim^-½, each chosen expert's weight times its learned scale."""
        experts = FAMILIES[self.family].experts
        return self.n_experts is not None and experts is not None \
            and "beside_mlp" in experts.options

    def _validate_sigmoid_router(self) -> None:
        groups, chosen = self.n_expert_groups, self.topk_expert_groups
        scale = self.routed_scaling_factor
        if not self.sigmoid_router:
            if (groups, chosen, scale) != (1, 1, 1.0):
                raise ConfigError("ModelConfig: n_expert_groups, topk_expert_groups and "
                                  "routed_scaling_factor are a sigmoid router's (glm4_moe); "
                                  f"family={self.family!r} routes by softmax: drop them")
            return
        if self.router_aux_loss_coef:
            raise ConfigError(f"ModelConfig.router_aux_loss_coef={self.router_aux_loss_coef!r}: "
                              f"family={self.family!r}'s class computes no balance loss; set 0 "
                              "and balance by the selection bias (pretraining's "
                              "moe_bias_update_rate)")
        for name, value in (("n_expert_groups", groups), ("topk_expert_groups", chosen)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{name}={value!r} must be a positive integer")
        if self.n_experts % groups or chosen > groups \
                or (groups > 1 and self.n_experts // groups < 2):
            raise ConfigError(f"ModelConfig.n_expert_groups={groups}, topk_expert_groups="
                              f"{chosen}: the {self.n_experts} experts must split into groups "
                              "of at least 2 (a group scores by its best two), of which at most "
                              "all are chosen")
        if chosen * (self.n_experts // groups) < self.n_experts_per_token:
            raise ConfigError(f"ModelConfig.topk_expert_groups={chosen} leaves fewer experts "
                              f"than n_experts_per_token={self.n_experts_per_token} to choose from")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
            raise ConfigError(f"ModelConfig.routed_scaling_factor={scale!r} must be a number > 0")

    def _validate_global_layers(self) -> None:
        takes = FAMILIES[self.family].takes
        for name in ("global_head_dim", "global_n_kv_heads", "global_k_is_v", "rope_proportion"):
            if getattr(self, name) not in (None, False) and name not in takes:
                raise ConfigError(f"ModelConfig.{name}={getattr(self, name)!r}: family="
                                  f"{self.family!r} has no such setting (Gemma 4's; drop it or "
                                  "choose gemma4_text)")
        for name in ("global_head_dim", "global_n_kv_heads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):
                raise ConfigError(f"ModelConfig.{name}={value!r} must be a positive integer "
                                  "(or null: the other layers' value)")
        if self.global_head_dim is not None and self.global_head_dim % 2:
            raise ConfigError(f"ModelConfig.global_head_dim={self.global_head_dim} is odd; RoPE "
                              "rotates pairs of channels")
        if self.n_heads % self.global_shape[0]:
            raise ConfigError(f"ModelConfig.global_n_kv_heads={self.global_n_kv_heads} does not "
                              f"divide n_heads={self.n_heads}: each KV head serves a whole group")
        apart = self.global_shape != (self.n_kv_heads, self.head_dim) or self.global_k_is_v \
            or self.rope_proportion is not None
        if apart and (self.layer_types is None or self.rope_local_theta is None):
            raise ConfigError("ModelConfig: global_head_dim, global_n_kv_heads, global_k_is_v "
                              "and rope_proportion set the full-attention layers apart: they need "
                              "layer_types (which layers are full) and rope_local_theta (the "
                              "sliding layers' own RoPE)")
        if self.family == "gemma4_text" and self.layer_types is not None \
                and self.layer_types[-1] != "full_attention":
            raise ConfigError(f"ModelConfig.layer_types ends {self.layer_types[-1]!r}: "
                              "gemma4_text's class makes its last layer full_attention; make it so")
        proportion = self.rope_proportion
        if proportion is not None and (not isinstance(proportion, (int, float))
                                       or not 0 < proportion <= 1
                                       or int(proportion * self.global_shape[1] // 2) == 0):
            raise ConfigError(f"ModelConfig.rope_proportion={proportion!r} must be in (0, 1] and "
                              "turn at least one pair of channels of a full-attention head")

    def _validate_shared_layers(self) -> None:
        takes = FAMILIES[self.family].takes
        for name in ("per_layer_dim", "kv_shared_layers", "double_wide_shared_mlp"):
            value = getattr(self, name)
            if value and name not in takes:
                raise ConfigError(f"ModelConfig.{name}={value!r}: family={self.family!r} has no "
                                  "such setting (Gemma 4's; drop it or choose gemma4_text)")
            if name != "double_wide_shared_mlp" and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ConfigError(f"ModelConfig.{name}={value!r} must be an integer >= 0 "
                                  "(0: none)")
        shared = self.kv_shared_layers
        if shared >= self.n_layers:
            raise ConfigError(f"ModelConfig.kv_shared_layers={shared}: at least one of the "
                              f"{self.n_layers} layers must compute the keys and values the "
                              "shared ones attend over")
        types, first = self.layer_types, self.n_layers - shared
        if types is not None and not set(types[first:]) <= set(types[:first]):
            raise ConfigError(f"ModelConfig.kv_shared_layers={shared}: the shared layers' "
                              f"kinds {sorted(set(types[first:]))} must each have an earlier "
                              "layer of that kind to share keys and values with; share fewer "
                              "layers")
        if self.double_wide_shared_mlp and not shared:
            raise ConfigError("ModelConfig.double_wide_shared_mlp widens the KV-sharing layers' "
                              "MLPs: it needs kv_shared_layers > 0")

    def _validate_linear_layers(self) -> None:
        takes = FAMILIES[self.family].takes
        if self.linear_layer_count and "linear_key_heads" not in takes:
            raise ConfigError(f"ModelConfig.layer_types: family={self.family!r} has no "
                              "'linear_attention' layers (Qwen3.5's; choose qwen3_5_text)")
        if not self.linear_layer_count:
            return
        for name in LINEAR_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{name}={value!r} must be a positive integer: "
                                  "layer_types has 'linear_attention' layers")
        if self.linear_value_heads % self.linear_key_heads:
            raise ConfigError(f"ModelConfig.linear_value_heads={self.linear_value_heads} is not a "
                              f"multiple of linear_key_heads={self.linear_key_heads}: each "
                              "query/key head serves a whole group of value heads")

    @property
    def linear_conv_channels(self) -> int:
        """The channels a Gated DeltaNet layer's convolution runs over: its q, k and v."""
        return (2 * self.linear_key_heads * self.linear_key_head_dim
                + self.linear_value_heads * self.linear_value_head_dim)

    @property
    def linear_layer_count(self) -> int:
        """How many layers are Gated DeltaNet layers (`layer_types`' "linear_attention")."""
        return 0 if self.layer_types is None else self.layer_types.count("linear_attention")

    def is_linear(self, layer: int) -> bool:
        """Whether layer `layer` is a Gated DeltaNet layer, not attention."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values layer `layer` attends over: itself, or for a
        KV-sharing layer the last layer before the shared ones of its kind (sliding, full)."""
        first = self.n_layers - self.kv_shared_layers
        if layer < first:
            return layer
        if self.layer_types is None:
            return first - 1
        kind = self.layer_types[layer]
        return max(i for i in range(first) if self.layer_types[i] == kind)

    def ffn_width(self, layer: int) -> int:
        """Layer `layer`'s dense MLP width (a KV-sharing layer's doubled when so set)."""
        doubled = self.double_wide_shared_mlp and layer >= self.n_layers - self.kv_shared_layers
        return self.ffn_hidden_dim * (2 if doubled else 1)

    @property
    def global_shape(self) -> tuple[int, int]:
        """(KV heads, head width) of the full-attention layers."""
        return (self.global_n_kv_heads or self.n_kv_heads, self.global_head_dim or self.head_dim)

    def is_global(self, layer: int) -> bool:
        """Whether layer `layer` attends over the whole context (a full-attention layer)."""
        return self.layer_types is None or self.layer_types[layer] == "full_attention"

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head width) of layer `layer`'s attention."""
        if self.layer_types is not None and self.is_global(layer):
            return self.global_shape
        return self.n_kv_heads, self.head_dim

    def k_is_v(self, layer: int) -> bool:
        """Whether layer `layer`'s values are its keys' projection (no v_proj)."""
        return self.global_k_is_v and self.layer_types is not None and self.is_global(layer)

    def kv_channels(self) -> int:
        """The K (or V) values one token leaves in a KV cache, all layers together (a
        KV-sharing layer leaves none of its own)."""
        return sum(count * math.prod(self.attention_shape(layer))
                   for count, layer in self._attention_kinds() if self.kv_source(layer) == layer)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.n_experts is not None and (self.moe_layers is None
                                               or bool(self.moe_layers[layer]))

    def _validate_shape(self, explicit_head_dim: bool) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "multiple_of",
                     "max_seq_len", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ModelConfig.{name}={value!r} must be a positive integer")
        if not isinstance(self.num_labels, int) or self.num_labels < 0:
            raise ConfigError(f"ModelConfig.num_labels={self.num_labels!r}: 0 for a language "
                              "model, or a sequence classifier's count of outputs")
        if self.num_labels and FAMILIES[self.family].classifier is None:
            raise ConfigError(f"ModelConfig.num_labels={self.num_labels}: transformers has no "
                              f"sequence classifier of family {self.family!r}, so its reward "
                              "model could not be exported; use another family")
        if not explicit_head_dim and self.dim % self.n_heads:
            raise ConfigError(
                f"ModelConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                "choose n_heads so that dim % n_heads == 0"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"ModelConfig: n_heads={self.n_heads} is not divisible by "
                f"n_kv_heads={self.n_kv_heads}; each KV head must serve a whole group of "
                "query heads (n_kv_heads = n_heads for MHA, 1 for MQA, a divisor for GQA)"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"ModelConfig: head_dim={self.head_dim} is odd; RoPE rotates pairs of "
                "channels, so pick an even head_dim (or dim and n_heads giving one)"
            )

    def _validate_window(self) -> None:
        window, types = self.sliding_window, self.layer_types
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ConfigError(f"ModelConfig.sliding_window={window!r} must be a positive "
                              "integer (or null for full attention)")
        sliding = FAMILIES[self.family].sliding
        if window is not None and sliding == "none" or types is not None and sliding == "all":
            raise ConfigError(
                f"ModelConfig: family={self.family!r} has no "
                + ("sliding window" if sliding == "none" else "per-layer windows")
                + f" (sliding_window={window!r}, layer_types={types!r}); drop them or choose "
                "a family that has them (mistral slides every layer; qwen2, qwen3 and "
                "smollm3 the layers layer_types marks)")
        if types is None:
            return
        if window is None and "sliding_attention" in types:
            raise ConfigError(f"ModelConfig.layer_types={types!r} needs sliding_window: the "
                              "window its sliding layers attend over")
        if len(types) != self.n_layers or set(types) - set(LAYER_TYPES):
            raise ConfigError(f"ModelConfig.layer_types={types!r} must name, for each of the "
                              f"{self.n_layers} layers, one of {', '.join(LAYER_TYPES)}")

    def window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends over, None for full attention."""
        if self.sliding_window is None or (self.layer_types is not None
                                           and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def _validate_rest(self) -> None:
        if self.ffn_hidden_dim <= 0:
            raise ConfigError(f"ModelConfig.ffn_hidden_dim={self.ffn_hidden_dim} must be positive")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"ModelConfig.hidden_act={self.hidden_act!r} must be one of "
                              f"{', '.join(ACTIVATIONS)}")
        takes = FAMILIES[self.family].takes
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap",
                     "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or value <= 0):
                raise ConfigError(f"ModelConfig.{name}={value!r} must be a positive number "
                                  "(or null)")
            if value is not None and name not in takes:
                raise ConfigError(f"ModelConfig.{name}={value!r}: family={self.family!r} has "
                                  "no such setting (Gemma's; drop it or choose a gemma family)")
        factor = self.partial_rotary_factor
        if not isinstance(factor, (int, float)) or not 0 < factor <= 1 \
                or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ConfigError(f"ModelConfig.partial_rotary_factor={factor!r} must be in (0, 1] "
                              f"and rotate an even, non-zero number of head_dim={self.head_dim}"
                              " channels")
        if factor != 1 and "partial_rotary_factor" not in takes:
            raise ConfigError(f"ModelConfig.partial_rotary_factor={factor!r}: family="
                              f"{self.family!r} rotates whole heads (drop it, or choose phi3)")
        if self.post_norms and self.sandwich_norms:
            raise ConfigError("ModelConfig.post_norms (OLMo 2's: norms after attention and the "
                              "MLP only) and sandwich_norms (Gemma's: before and after) exclude "
                              "each other; set one")
        if self.rope_local_theta is not None and self.layer_types is None:
            raise ConfigError("ModelConfig.rope_local_theta is the sliding layers' RoPE base: "
                              "it needs layer_types to say which layers slide")
        for name in ("norm_eps", "rope_theta", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"ModelConfig.{name}={value!r} must be a positive number")
        scaling = self.rope_scaling
        if scaling is not None:
            if scaling.rope_type not in ROPE_TYPES:
                raise ConfigError(f"ModelConfig.rope_scaling.rope_type={scaling.rope_type!r} "
                                  f"must be one of {', '.join(ROPE_TYPES)} (or rope_scaling: "
                                  "null for none)")
            if scaling.factor < 1:
                raise ConfigError(
                    f"ModelConfig.rope_scaling.factor={scaling.factor} must be >= 1 "
                    "(it stretches the context; use rope_scaling: null for none)"
                )
            if scaling.rope_type == "llama3" and \
                    scaling.high_freq_factor <= scaling.low_freq_factor:
                raise ConfigError(
                    "ModelConfig.rope_scaling: high_freq_factor="
                    f"{scaling.high_freq_factor} must exceed low_freq_factor="
                    f"{scaling.low_freq_factor}"
                )
            for name in ("short_factor", "long_factor"):
                factors = getattr(scaling, name)
                if scaling.rope_type == "longrope" and (
                        not isinstance(factors, list) or len(factors) != self.rotary_dim // 2
                        or not all(isinstance(f, (int, float)) and f > 0 for f in factors)):
                    raise ConfigError(
                        f"ModelConfig.rope_scaling.{name}: LongRoPE needs one positive factor "
                        f"per rotated frequency ({self.rotary_dim // 2}), got {factors!r}")

    @property
    def rotary_dim(self) -> int:
        """How many channels of each head RoPE rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_dim(self) -> int:
        """Width of the query heads together (dim, unless head_dim is set apart)."""
        return self.n_heads * self.head_dim

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A named preset, with any field replaced by `overrides` (checked like a recipe).
        A `family` other than llama brings what a new model of that family switches on
        (`lathe.model.families.fresh_switches`), under the overrides."""
        if name not in PRESETS:
            raise ConfigError(
                f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}"
            )
        fields = {**PRESETS[name], **overrides}
        family = fields.get("family", "llama")
        if family != "llama" and isinstance(fields.get("n_layers"), int) \
                and isinstance(fields.get("n_heads"), int) and isinstance(fields.get("dim"), int):
            head_dim = fields.get("head_dim") or fields["dim"] // fields["n_heads"]
            expert_width = fields.get("moe_ffn_hidden_dim") or fields.get("ffn_hidden_dim") \
                or llama_ffn_hidden_dim(fields["dim"], fields.get("multiple_of", cls.multiple_of),
                                        fields.get("ffn_dim_multiplier"))
            fields = {**PRESETS[name], **fresh_switches(family, fields["n_layers"], head_dim,
                                                        expert_width, fields["n_heads"]),
                      **overrides}
        return from_dict(cls, fields)

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count, counting a tied embedding/LM-head matrix once.

        Without embeddings, both the token embedding and an untied LM head are left out
        (Kaplan et al.'s non-embedding count).
        """
        norms = 4 if self.sandwich_norms else 2
        kv_dim = self.n_kv_heads * self.head_dim
        head_norms = self.qk_norm * sum(  # q's norm, and k's where the layer computes k
            count * (1 + (self.kv_source(layer) == layer)) * self.attention_shape(layer)[1]
            for count, layer in self._attention_kinds())
        per_layer = (norms * self.dim  # the RMSNorm weights
                     + (self.q_dim + kv_dim) * self.qk_norm_projection
                     + (self.dim if self.per_layer_dim else 0)  # the per-layer input's norm
                     # beside the MLP: the experts' three norms, the router's two scales
                     + (4 * self.dim + self.n_experts if self.experts_beside_mlp else 0))
        body = (self._linear_params() + self.n_layers * per_layer + head_norms + self.dim
                + self.per_layer_dim  # the per-layer inputs' projection norm
                + self.linear_layer_count * self._delta_net_extras())
        per_layer_table = self.vocab_size * self.n_layers * self.per_layer_dim
        if not include_embeddings:
            return body
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return body + embeddings + per_layer_table

    def _delta_net_extras(self) -> int:
        """A Gated DeltaNet layer's parameters outside its linears: the convolution's
        weights, each value head's decay and step bias, and the output norm's weight."""
        conv = self.linear_conv_channels * self.linear_conv_kernel
        return conv + 2 * self.linear_value_heads + self.linear_value_head_dim

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), for MFU.

        6 x (every weight used in a matmul for a token: the layers' linears — of a mixture of
        experts, the router and the `n_experts_per_token` experts a token goes to — and the
        LM head, even when tied; not the embedding lookup or the norms) plus the attention
        term 12 x (the layers' q widths summed) x seq_len (PaLM, appendix B; the causal half
        is not discounted, as in nanoGPT and torchtitan); a Gated DeltaNet layer's recurrence
        reads and writes a (key width x value width) state per value head: 6 x 4 x that.
        """
        seq_len = self.max_seq_len if seq_len is None else seq_len
        matmul_params = self._linear_params(active=True) + self.vocab_size * self.dim
        q_dims = sum(count * self.n_heads * self.attention_shape(layer)[1]
                     for count, layer in self._attention_kinds())
        state = self.linear_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return 6 * matmul_params + 12 * q_dims * seq_len \
            + 24 * state * self.linear_layer_count

    def _linear_params(self, active: bool = False) -> int:
        """The layers' matmul weights: all of them, or those one token uses (`active`).
        Counted by kind of layer, not layer by layer: a hostile config.json's million layers
        must be refused at once (`check_memory`)."""
        attention = 0
        for count, layer in self._attention_kinds():
            kv_heads, width = self.attention_shape(layer)
            q_dim, kv_dims = self.n_heads * width, kv_heads * width * (1 + (not self.k_is_v(layer)))
            if self.kv_source(layer) != layer:  # a KV-sharing layer projects no k or v
                kv_dims = 0
            gate = q_dim * self.attn_output_gate  # q_proj's second half, the output gate
            attention += count * ((2 * q_dim + gate) * self.dim + self.dim * kv_dims
                                  + self.dim * self.o_bias + (q_dim + kv_dims) * self.qkv_bias)
        keys = self.linear_key_heads * self.linear_key_head_dim
        values = self.linear_value_heads * self.linear_value_head_dim
        # in_proj_qkv, in_proj_z, in_proj_a and in_proj_b, out_proj
        attention += self.linear_layer_count * self.dim * (
            2 * keys + 3 * values + 2 * self.linear_value_heads)
        # per-layer inputs: the model's projection to them, each layer's gate and projection
        attention += 3 * self.n_layers * self.dim * self.per_layer_dim
        moe_layers = 0 if self.n_experts is None else (
            self.n_layers if self.moe_layers is None else sum(self.moe_layers))
        doubled = self.kv_shared_layers if self.double_wide_shared_mlp else 0
        dense = (self.n_layers - moe_layers + doubled) * 3 * self.dim * self.ffn_hidden_dim
        if not moe_layers:
            return attention + dense
        experts = self.n_experts_per_token if active else self.n_experts
        shared = (3 * self.dim * self.shared_expert_dim + self.dim * self.shared_expert_gate
                  if self.shared_expert_dim else 0)
        moe = self.dim * self.n_experts + experts * 3 * self.dim * self.moe_ffn_hidden_dim + shared
        return attention + dense + moe_layers * moe

    def _attention_kinds(self) -> list[tuple[int, int]]:
        """(how many layers, one of them) for each kind of attention layer (sliding, full;
        computing its keys and values or sharing another's): counted by kind, not layer by
        layer, as `_linear_params` counts."""
        first_shared = self.n_layers - self.kv_shared_layers
        kinds: list[tuple[int, int]] = []
        for start, end in ((0, first_shared), (first_shared, self.n_layers)):
            if self.layer_types is None:
                kinds += [(end - start, start)] if end > start else []
                continue
            span = self.layer_types[start:end]
            kinds += [(span.count(kind), start + span.index(kind))
                      for kind in ATTENTION_TYPES if kind in span]
        return kinds

    def require_language_model(self, what: str) -> None:
        """Refuse a sequence classifier (a reward model) where `what` needs next-token logits."""
        if self.num_labels:
            raise ConfigError(f"{what} needs a language model; this checkpoint is a sequence "
                              f"classifier (num_labels={self.num_labels}: a reward model), "
                              "which scores text and does not generate it")

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` body of this family's HF class (`LlamaForCausalLM`, ...).

        RoPE is written in the top-level `rope_theta` / `rope_scaling` form, which
        transformers 4.x and 5.x, vLLM and llama.cpp's converter all read, and per layer type
        (`rope_parameters`) for the families that keep it so.
        """
        scaling = self.rope_scaling
        family = FAMILIES[self.family]
        labels = {"id2label": {str(i): f"LABEL_{i}" for i in range(self.num_labels)},
                  "label2id": {f"LABEL_{i}": i for i in range(self.num_labels)}
                  } if self.num_labels else {}
        body = {
            "architectures": [family.classifier if self.num_labels else family.architecture],
            **labels,
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": scaling.original_max_seq_len  # what "dynamic" scales
            if scaling is not None and scaling.rope_type == "dynamic" else self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.hf_rope_scaling(),
            "tie_word_embeddings": self.tie_embeddings,
            "initializer_range": self.init_std,
            "attention_dropout": 0.0,
            "use_cache": True,
            # the tokenizer's, when the checkpoint has one (save_checkpoint fills them in);
            # left out, a family's class would assume its own model's (SmolLM3: 128000...)
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            **family.extra(self),
        }
        if body["rope_scaling"] is None and "rope_parameters" in body:
            del body["rope_scaling"]  # Gemma 4's class would read it as rope_parameters: None
        return body

    def hf_rope_scaling(self) -> dict[str, Any] | None:
        """`rope_scaling` as config.json holds it (None: unscaled)."""
        rope_scaling = None
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "llama3":
            rope_scaling = {
                "rope_type": "llama3",
                "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_seq_len,
            }
        elif scaling is not None and scaling.rope_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": scaling.factor}
        elif scaling is not None and scaling.rope_type == "dynamic":
            rope_scaling = {"rope_type": "dynamic", "factor": scaling.factor}
        elif scaling is not None and scaling.rope_type == "longrope":
            rope_scaling = {"rope_type": "longrope", "factor": scaling.factor,
                            "original_max_position_embeddings": scaling.original_max_seq_len,
                            "short_factor": scaling.short_factor,
                            "long_factor": scaling.long_factor, **(
                                {"attention_factor": scaling.attention_factor}
                                if scaling.attention_factor is not None else {})}
        elif scaling is not None:
            rope_scaling = {"rope_type": "yarn", "factor": scaling.factor,
                            "original_max_position_embeddings": scaling.original_max_seq_len,
                            "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow,
                            "truncate": scaling.truncate, **{
                                key: getattr(scaling, key) for key in
                                ("attention_factor", "mscale", "mscale_all_dim")
                                if getattr(scaling, key) is not None}}
        return rope_scaling

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read an HF `config.json` of a family lathe takes (transformers 4.x or 5.x layout);
        anything it cannot compute exactly is refused, naming the field. A multimodal
        checkpoint of a family's language model (`WRAPPERS`) is read as that model's."""
        hf = language_model_config(hf)
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ConfigError(
                f"config.json: model_type={model_type!r} is not supported; lathe loads "
                f"{', '.join(FAMILIES)}, and the language model of "
                f"{', '.join(WRAPPERS)}")
        family = FAMILIES[model_type]
        if hf.get("mlp_bias", False):
            raise ConfigError(f"config.json: mlp_bias={hf['mlp_bias']!r} is not supported "
                              "(only False)")
        act_key = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
        if hf.get(act_key, "silu") not in ACTIVATIONS:
            raise ConfigError(f"config.json: {act_key}={hf[act_key]!r} is not supported (only "
                              f"{', '.join(repr(a) for a in ACTIVATIONS)})")
        bidirectional = hf.get("use_bidirectional_attention")
        if bidirectional and not (bidirectional == "vision" and model_type == "gemma4_text"):
            # Gemma 4's "vision": among an image's tokens only, which a text model has none of
            raise ConfigError(f"config.json: use_bidirectional_attention={bidirectional!r} is "
                              "not supported: lathe's models are causal decoders")
        keys = ("vision_config",) if family.experts else (
            "num_experts", "num_local_experts", "vision_config")
        for key in keys:
            if hf.get(key):
                raise ConfigError(f"config.json: {key}={hf[key]!r} is not supported for "
                                  f"model_type={model_type!r}: lathe's mixtures of experts "
                                  "are " + ", ".join(n for n, f in FAMILIES.items() if f.experts)
                                  + ", and it has no vision tower")
        window, layer_types = family.window(hf)
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        rope, rope_theta = family.rope(hf)
        rope_type = rope["rope_type"]
        if rope_type not in ("default", *ROPE_TYPES):
            raise ConfigError(
                f"config.json: rope type {rope_type!r} is not supported (only 'default', "
                f"{', '.join(repr(t) for t in ROPE_TYPES)})")
        scaling = None
        positions = hf.get("max_position_embeddings", 2048)
        if rope_type == "longrope":
            original = rope.get("original_max_position_embeddings") \
                or hf.get("original_max_position_embeddings") or positions
            scaling = RopeScaling(
                factor=rope.get("factor") or positions / original, rope_type="longrope",
                original_max_seq_len=original, attention_factor=rope.get("attention_factor"),
                short_factor=[float(f) for f in rope["short_factor"]],
                long_factor=[float(f) for f in rope["long_factor"]])
        elif rope_type == "llama3":
            scaling = RopeScaling(
                factor=rope["factor"],
                low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_seq_len=rope["original_max_position_embeddings"],
            )
        elif rope_type == "linear":
            scaling = RopeScaling(factor=rope["factor"], rope_type="linear")
        elif rope_type == "dynamic":
            scaling = RopeScaling(factor=rope["factor"], rope_type="dynamic",
                                  original_max_seq_len=positions)
            positions = int(positions * max(rope["factor"], 1.0))
        elif rope_type == "yarn":
            original = rope.get("original_max_position_embeddings") or positions
            scaling = RopeScaling(
                factor=rope.get("factor") or positions / original, rope_type="yarn",
                original_max_seq_len=original, beta_fast=rope.get("beta_fast") or 32.0,
                beta_slow=rope.get("beta_slow") or 1.0, truncate=rope.get("truncate", True),
                attention_factor=rope.get("attention_factor"), mscale=rope.get("mscale"),
                mscale_all_dim=rope.get("mscale_all_dim"))
        fields = dict(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            ffn_hidden_dim=hf.get("intermediate_size"),  # Qwen3.5-MoE has none: its read sets it
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_seq_len=positions,
            tie_embeddings=hf.get("tie_word_embeddings", False),
            init_std=hf.get("initializer_range", 0.02),
            head_dim=head_dim,
            family=model_type,
            sliding_window=window,
            layer_types=layer_types,
            hidden_act=hf.get(act_key, "silu"),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            attn_softcap=hf.get("attn_logit_softcapping"),
            final_softcap=hf.get("final_logit_softcapping"),
            partial_rotary_factor=float(rope.get("partial_rotary_factor")
                                        or hf.get("partial_rotary_factor") or 1.0),
            clip_qkv=hf.get("clip_qkv"),
            num_labels=_num_labels(hf),
        )
        fields = {**fields, **family.read(hf),
                  **(family.experts.read(hf) if family.experts else {}), **family.switches(hf)}
        if fields["ffn_hidden_dim"] is None:
            raise ConfigError(f"config.json: intermediate_size is missing; {model_type}'s MLP "
                              "width must be given")
        return cls(**fields)


def _num_labels(hf: dict[str, Any]) -> int:
    """0 for a causal LM; a sequence classifier's label count (its id2label, as transformers
    counts them, else num_labels, else transformers' default of 2)."""
    architectures = hf.get("architectures") or [""]
    if not str(architectures[0]).endswith("ForSequenceClassification"):
        return 0
    labels = hf.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    count = hf.get("num_labels", 2)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ConfigError(f"config.json: num_labels={count!r} must be a positive integer")
    return count


def llama_ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim, optionally scaled, rounded up to `multiple_of`."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


# Presets never pin ffn_hidden_dim, so overriding dim re-derives the FFN width.
PRESETS: dict[str, dict[str, Any]] = {
    # ~1M parameters: unit tests and smoke runs.
    "tiny": dict(vocab_size=2048, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                 multiple_of=32, max_seq_len=256),
    # ~13M parameters: the CPU end-to-end run.
    "nano": dict(vocab_size=8192, dim=384, n_layers=6, n_heads=6, n_kv_heads=2,
                 multiple_of=256, max_seq_len=512),
    # ~125M parameters: GPT-2-small scale.
    "small": dict(vocab_size=49152, dim=768, n_layers=12, n_heads=12, multiple_of=256,
                  max_seq_len=2048),
    # Llama-3.2-1B shape.
    "1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
               multiple_of=256, ffn_dim_multiplier=1.5, rope_theta=500000.0,
               rope_scaling={"factor": 32.0},
               max_seq_len=131072),
    # Llama-3-8B shape.
    "8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
               multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0,
               max_seq_len=8192, tie_embeddings=False),
}
