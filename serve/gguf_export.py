"""A checkpoint as one GGUF file for llama.cpp (and Ollama, LM Studio), written with the
`gguf` package: the architecture's hyper-parameters, the vocabulary as llama.cpp tokenizes
it (`lathe.serve.gguf_vocab`: byte-level BPE, SentencePiece or Gemma 4's ranked BPE,
end-of-turn ids), the chat template, and every tensor under llama.cpp's name in f32 (the
exact weights, to compare runtimes on the same numbers), f16, bf16 or q8_0.

Each family is written as the llama.cpp architecture its converter makes of it (`ARCHES`):
llama, mistral and mixtral as `llama`; qwen2, qwen3, gemma2, gemma3, gemma4, phi3, qwen2_moe
(`qwen2moe`), qwen3_moe (`qwen3moe`), olmoe, olmo2 and glm4_moe (`glm4moe`) as themselves,
olmo3 as `olmo2` with its window, qwen3_5_text, qwen3_5_moe_text and qwen3_next as `qwen35`,
`qwen35moe` and `qwen3next` (Phi-3's projections stay fused: `attn_qkv`, and gate and up as
one `ffn_up`; OLMo's norms after attention and the MLP are `post_attention_norm` and
`post_ffw_norm`; Qwen3.5's Gated DeltaNet layers are `attn_qkv`, `attn_gate`, `ssm_*` as its
converter writes them, `_delta_net_tensor`, Qwen3-Next's fused `ssm_in` and `ssm_ba`).
A mixture of experts' router is `ffn_gate_inp`, its experts
stacked `ffn_gate_exps`, `ffn_up_exps` and `ffn_down_exps`, a shared expert `ffn_*_shexp`
(Qwen2-MoE's gate `ffn_gate_inp_shexp`); GLM-4.5's sigmoid router's selection bias is
`exp_probs_b`, its norm after attention `post_attention_norm`, and its routing (sigmoid
gating, groups, weight scale, leading dense layers) goes in as keys. Layout facts that
matter: llama.cpp's `llama` RoPE rotates adjacent pairs (2i, 2i + 1) while HF
checkpoints rotate halves (i, i + d/2), so for it q_proj and k_proj rows are permuted per
head (`permute_rope_rows`), as llama.cpp's own converter does; the other architectures
rotate halves (NEOX) and take the rows as they are. Gemma's norms are stored as 1 + w (not
Gemma 4's); Gemma 4's layer scalars are `layer_output_scale`, its two layer kinds' widths,
KV heads and RoPE go in as the main and `_swa` keys, and its full layers' proportional RoPE
as `rope_freqs` (1e30 for a frequency that does not turn).
Llama-3 frequency scaling travels as `rope_freqs.weight`, the per-frequency divisors; YaRN as
llama.cpp's keys (type, factor, original context, betas, and the attention factor it applies
beside its own 1 + 0.1 ln(factor)); Phi-3's LongRoPE as `rope_factors_long` and
`rope_factors_short` (llama.cpp takes the long ones when its context passes the original
one, where transformers and lathe look at each forward's positions). What
an architecture's llama.cpp graph fixes rather than reads (Gemma's query scale and window
pattern, Gemma 3's local RoPE base, OLMo 3's three sliding layers in four and their base,
llama's and phi3's full attention) a checkpoint must match, or the export refuses it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor

from lathe.data.chat_template import checkpoint_chat_templates
from lathe.model.checkpoint import CheckpointError, load_checkpoint
from lathe.model.config import ModelConfig
from lathe.model.families import join_fused
from lathe.model.transformer import rope_inv_freq
from lathe.serve.gguf_vocab import gguf_vocabulary

FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
# the matrices' GGML types the `gguf` package rounds them to (f16 is a numpy dtype)
ROUNDED = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# GLM-4.5's: the MLP's input norm is named as the output of attention's
GLM4_MOE_NAMES = {**LAYER_NAMES, "post_attention_layernorm": "post_attention_norm"}
# Gemma's four norms a layer: the one after attention, and the MLP's before and after
SANDWICH_NAMES = {**LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"}
# Gemma 4's: Gemma's four norms, the scalar each layer's output is multiplied by, and (E2B,
# E4B) the branch each layer's own input gates
GEMMA4_NAMES = {**SANDWICH_NAMES, "layer_scalar": "layer_output_scale",
                "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj",
                "post_per_layer_input_norm": "post_norm"}
# 26B-A4B's: the MLP beside the experts (lathe's shared expert) is the layer's ffn, its norm
# after `post_ffw_norm_1`, the experts' before and after `pre_ffw_norm_2`, `post_ffw_norm_2`
GEMMA4_MOE_NAMES = {**GEMMA4_NAMES, "mlp.shared_expert.gate_proj": "ffn_gate",
                    "mlp.shared_expert.up_proj": "ffn_up",
                    "mlp.shared_expert.down_proj": "ffn_down",
                    "mlp.shared_expert_norm": "post_ffw_norm_1",
                    "mlp.experts_input_norm": "pre_ffw_norm_2",
                    "mlp.experts_norm": "post_ffw_norm_2"}
# a layer's parameters beyond its modules' weights: GLM-4.5's router's selection bias, Gemma
# 4's router's input scale and per-expert weight scale; Qwen3.5's Gated DeltaNet's decay
# (stored as A = −exp(A_log)) and step bias
PARAMETER_NAMES = {"mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
                   "mlp.gate.scale": "ffn_gate_inp.scale",
                   "mlp.gate.per_expert_scale": "ffn_down_exps.scale",
                   "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias"}
# Qwen3.5's: the MLP's input norm named as GLM-4.5's, and the Gated DeltaNet layers' modules
QWEN3_5_NAMES = {**LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                 "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
                 "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
                 "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm",
                 "linear_attn.out_proj": "ssm_out",
                 # Qwen3-Next's fused projections (llama.cpp's qwen3next splits them by key head)
                 "linear_attn.in_proj_qkvz": "ssm_in", "linear_attn.in_proj_ba": "ssm_ba"}
# OLMo 2's: norms after attention and after the MLP, none before
POST_NORM_NAMES = {**LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                   "post_feedforward_layernorm": "post_ffw_norm"}
QWEN3_5_ARCHES = ("qwen35", "qwen35moe", "qwen3next")
# lathe family -> llama.cpp architecture
ARCHES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
          "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "mixtral": "llama",
          "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "qwen2_moe": "qwen2moe",
          "glm4_moe": "glm4moe", "olmo2": "olmo2", "olmo3": "olmo2", "gemma4_text": "gemma4",
          "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}
# whether llama.cpp's graph for an architecture renormalizes the top-k expert weights (glm4moe
# reads it from the file)
EXPERT_WEIGHTS_NORM = {"llama": True, "qwen3moe": True, "olmoe": False, "qwen2moe": False,
                       "qwen35moe": True, "qwen3next": True}


def permute_rope_rows(weight: Tensor, n_heads: int) -> Tensor:
    """Reorder each head's output rows from rotate-half to adjacent-pair RoPE layout."""
    out_features, in_features = weight.shape
    head_dim = out_features // n_heads
    return (weight.reshape(n_heads, 2, head_dim // 2, in_features).transpose(1, 2)
            .reshape(out_features, in_features))


def gguf_tensor_name(name: str, names: dict[str, str] = LAYER_NAMES) -> str:
    """llama.cpp's name for an HF parameter name, by the architecture's layer `names`."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
             # Gemma 4 E2B/E4B: the per-layer inputs' table, projection and norm
             "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
             "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
             "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}
    if name in fixed:
        return fixed[name]
    _, _, index, rest = name.split(".", 3)
    if rest in PARAMETER_NAMES:
        return f"blk.{index}.{PARAMETER_NAMES[rest]}"
    module, _, kind = rest.rpartition(".") if rest.endswith((".weight", ".bias")) \
        else (rest, "", "weight")  # stacked experts are parameters of their own
    if module not in names or kind not in ("weight", "bias"):
        raise CheckpointError(f"no GGUF name for parameter {name}")
    return f"blk.{index}.{names[module]}.{kind}"


def gguf_tensors(state: dict[str, Tensor], config: ModelConfig) -> dict[str, np.ndarray]:
    """fp32 arrays under llama.cpp's names, a tied LM head left out: q/k rows permuted for
    the `llama` architecture, Gemma's norms as 1 + w, Phi-3's projections fused."""
    out = {}
    permute = ARCHES[config.family] == "llama"
    names = GEMMA4_MOE_NAMES if config.experts_beside_mlp else GEMMA4_NAMES \
        if config.layer_scalar else SANDWICH_NAMES if config.sandwich_norms \
        else POST_NORM_NAMES if config.post_norms \
        else GLM4_MOE_NAMES if config.family == "glm4_moe" \
        else QWEN3_5_NAMES if config.linear_layer_count else LAYER_NAMES
    for name, tensor in _split_gate_up(join_fused(state, config)).items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        tensor = tensor.detach().float().cpu()
        if ".linear_attn." in name:
            tensor = _delta_net_tensor(name, tensor, config)
        elif permute and name.endswith("q_proj.weight"):
            tensor = permute_rope_rows(tensor, config.n_heads)
        elif permute and name.endswith("k_proj.weight"):
            tensor = permute_rope_rows(tensor, config.n_kv_heads)
        elif config.norm_unit_offset and "norm" in name:
            tensor = tensor + 1
        out[gguf_tensor_name(name, names)] = tensor.numpy()
    scaling = config.rope_scaling
    if config.family == "gemma4_text":  # llama.cpp's gemma4 reads its full layers' turning
        # frequencies from it (1) and the ones that do not turn (proportional RoPE) as 1e30
        turning = (rope_inv_freq(dataclasses.replace(config, head_dim=config.global_shape[1]))
                   > 0).numpy()
        out["rope_freqs.weight"] = np.where(turning, 1.0, 1e30).astype(np.float32)
    elif scaling is not None and scaling.rope_type == "longrope":
        out["rope_factors_long.weight"] = np.asarray(scaling.long_factor, dtype=np.float32)
        out["rope_factors_short.weight"] = np.asarray(scaling.short_factor, dtype=np.float32)
    elif scaling is not None and scaling.rope_type != "yarn":
        plain = dataclasses.replace(config, rope_scaling=None)
        out["rope_freqs.weight"] = (rope_inv_freq(plain) / rope_inv_freq(config)).numpy()
    return out


def _delta_net_tensor(name: str, tensor: Tensor, config: ModelConfig) -> Tensor:
    """A Gated DeltaNet parameter as llama.cpp's qwen35 and qwen3next read it (their
    converter's rules): the decay as A = −exp(A_log), the convolution's weight (channels,
    kernel), and — qwen35, with fewer key heads than value heads — the value heads in tiled
    order (head j of every key head's group, then j + 1: ggml repeats the key heads whole)
    where transformers groups them by key head (qwen3next repeats each key head in place)."""
    if name.endswith(".A_log"):
        tensor = -tensor.exp()
    elif name.endswith(".conv1d.weight"):
        tensor = tensor[:, 0]
    groups = config.linear_value_heads // config.linear_key_heads
    if groups == 1 or ARCHES[config.family] == "qwen3next":
        return tensor

    def tiled(part: Tensor, width: int, dim: int = 0) -> Tensor:
        shape = list(part.shape)
        grouped = part.unflatten(dim, (config.linear_key_heads, groups, width))
        return grouped.transpose(dim, dim + 1).reshape(shape)
    width = config.linear_value_head_dim
    keys = 2 * config.linear_key_heads * config.linear_key_head_dim
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):  # the values follow q, k
        return torch.cat((tensor[:keys], tiled(tensor[keys:], width)))
    if name.endswith(".in_proj_z.weight"):
        return tiled(tensor, width)
    if name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return tiled(tensor, 1)
    if name.endswith(".out_proj.weight"):
        return tiled(tensor, width, dim=1)
    return tensor


def _write_delta_net_layers(writer: gguf.GGUFWriter, config: ModelConfig) -> None:
    """Qwen3.5's Gated DeltaNet shape as llama.cpp's qwen35 and qwen3next read it (the keys
    its converter writes from config.json): the convolution's width, the key width (its
    "state size"), the key heads (groups), the value heads (the "time-step rank") and their
    width together, which layers attend (every `interval`-th), and qwen35's RoPE sections."""
    writer.add_ssm_conv_kernel(config.linear_conv_kernel)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_key_heads)
    writer.add_ssm_time_step_rank(config.linear_value_heads)
    writer.add_ssm_inner_size(config.linear_value_heads * config.linear_value_head_dim)
    writer.add_full_attention_interval(_full_attention_interval(config))
    if ARCHES[config.family] == "qwen3next":  # plain partial RoPE
        return
    # llama.cpp turns positions by interleaved multimodal RoPE, pair i by the time, height or
    # width section (i mod 3) while i is within it, else by a fourth that is 0 for text: the
    # sections cover every rotated pair (Qwen3.5's [11, 11, 10] of its 32), and since a text
    # position is the same in all three, they turn it as plain RoPE does
    pairs = config.rotary_dim // 2
    writer.add_rope_dimension_sections([(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3, 0])


def _full_attention_interval(config: ModelConfig) -> int:
    """Every how many layers one attends (Qwen3.5's layer pattern), from its first such."""
    assert config.layer_types is not None
    return config.layer_types.index("full_attention") + 1 \
        if "full_attention" in config.layer_types else config.n_layers + 1


def _write_gemma4_layers(writer: gguf.GGUFWriter, config: ModelConfig) -> None:
    """Gemma 4's two kinds of layer as llama.cpp's converter writes them: which slide, the
    full ones' head width and KV heads as the main keys and the sliding ones' as `_swa`,
    each kind's RoPE base and turned width (the full ones' share that does not turn is in
    `rope_freqs`), the per-layer inputs' width and the KV-sharing layers' count (E2B, E4B),
    and each layer's MLP width where those layers' are doubled."""
    kv_heads, width = config.global_shape
    writer.add_sliding_window_pattern([config.window(i) is not None
                                       for i in range(config.n_layers)])
    writer.add_key_length(width)
    writer.add_value_length(width)
    writer.add_key_length_swa(config.head_dim)
    writer.add_value_length_swa(config.head_dim)
    writer.add_head_count_kv([config.attention_shape(i)[0] for i in range(config.n_layers)])
    writer.add_rope_dimension_count(width)
    writer.add_rope_dimension_count_swa(config.rotary_dim)
    writer.add_rope_freq_base_swa(config.rope_local_theta)
    writer.add_shared_kv_layers(config.kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.per_layer_dim)


def _split_gate_up(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Stacked experts' gate and up rows as the two stacks llama.cpp keeps apart."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = tensor
    return out


def unwritable(config: ModelConfig) -> str | None:
    """Why llama.cpp's graph for this model's architecture would compute other logits than
    the checkpoint does (what it fixes rather than reads from the file), or None."""
    arch, scaling = ARCHES.get(config.family), config.rope_scaling
    window = config.sliding_window is not None and config.sliding_window < config.max_seq_len
    pattern = {"gemma2": 2, "gemma3": 6, "olmo2": 4}.get(arch)  # 1 full layer in each N
    reasons = [
        config.num_labels and "a sequence classifier (a reward model) has no LM head to write",
        arch is None and f"{config.family} has no llama.cpp architecture here",
        scaling is not None and scaling.rope_type == "dynamic"
        and "dynamic RoPE scaling is not written to GGUF yet",
        scaling is not None and scaling.rope_type == "longrope" and arch != "phi3"
        and f"llama.cpp reads LongRoPE's factors for phi3 only, not {arch}",
        scaling is not None and scaling.rope_type == "yarn" and not scaling.truncate
        and "llama.cpp's YaRN rounds its ramp's ends (truncate=true), not this one's",
        scaling is not None and scaling.rope_type == "linear" and arch == "llama"
        and "linear RoPE scaling of a llama model is not written to GGUF yet",
        scaling is not None and arch == "gemma4"
        and "RoPE scaling of Gemma 4's full layers is not written to GGUF yet",
        arch == "llama" and config.qkv_bias and "llama.cpp's llama has no attention biases",
        arch in ("llama", "phi3") and window
        and f"llama.cpp's {arch} attends in full, not in a window",
        config.no_rope_layers is not None and "SmolLM3's NoPE layers",
        pattern and config.layer_types is not None and config.layer_types != [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(config.n_layers)]
        and f"llama.cpp's {arch} slides {pattern - 1} of each {pattern} layers",
        arch in ("gemma2", "gemma3") and config.query_pre_attn_scalar != config.head_dim
        and f"llama.cpp's {arch} scales queries by head_dim^-1/2, not by "
            f"query_pre_attn_scalar={config.query_pre_attn_scalar}",
        arch == "gemma3" and config.rope_local_theta != 10_000
        and "llama.cpp's gemma3 rotates its sliding layers with base 10000",
        arch == "olmo2" and config.rope_local_theta not in (None, config.rope_theta)
        and "llama.cpp's olmo2 rotates its sliding layers with the full ones' base",
        arch == "gemma2" and not config.tie_embeddings
        and "llama.cpp's gemma2 ties its head to the embeddings",
        config.n_experts and arch in EXPERT_WEIGHTS_NORM
        and config.norm_topk_prob != EXPERT_WEIGHTS_NORM[arch]
        and f"llama.cpp's {arch} "
            f"{'does not renormalize' if config.norm_topk_prob else 'renormalizes'}"
            " the top-k expert weights",
        arch == "olmoe" and config.clip_qkv is not None
        and "llama.cpp's olmoe clamps q, k and v before the q/k norms, transformers after them",
        arch == "olmoe" and config.n_kv_heads != config.n_heads
        and "llama.cpp's olmoe norms k over all n_heads heads: it takes no grouped KV heads",
        config.moe_layers is not None and not all(config.moe_layers) and arch != "glm4moe"
        and f"llama.cpp's {arch} has experts in every layer (no mlp_only_layers)",
        arch in QWEN3_5_ARCHES and config.linear_layer_count and config.layer_types != [
            "linear_attention" if (i + 1) % _full_attention_interval(config) else
            "full_attention" for i in range(config.n_layers)]
        and f"llama.cpp's {arch} attends in every N-th layer alone (full_attention_interval), "
            f"not in these: {config.layer_types}",
        arch in QWEN3_5_ARCHES and config.qkv_bias
        and f"llama.cpp's {arch} has no attention biases",
        arch in QWEN3_5_ARCHES and not config.linear_layer_count
        and f"llama.cpp's {arch} needs its linear-attention layers",
        arch == "qwen3next" and config.shared_expert_dim is None
        and "llama.cpp's qwen3next needs its shared expert",
        arch in QWEN3_5_ARCHES and config.linear_layer_count
        and config.linear_key_head_dim != config.linear_value_head_dim
        and f"llama.cpp's {arch} takes the DeltaNet's value heads as wide as its key "
            f"heads, not {config.linear_value_head_dim} against {config.linear_key_head_dim}",
    ]
    found = [reason for reason in reasons if reason]
    return f"this {config.family} model: {'; '.join(found)}" if found else None


# llama.cpp sets token attributes by the model's *name*: one that contains "phi3" or
# "phi-3" has these tokens looked up, and a vocabulary without one of them fails to load
PHI3_NAMED_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def _model_name(name: str, tokens: list[str]) -> str:
    """The folder's name as `general.name`, unless llama.cpp's name-based Phi-3 rule
    would look up tokens this vocabulary lacks (a lathe tokenizer in a folder named
    `phi3-...`): then the name without "phi"."""
    if re.search("phi-?3", name.lower()) and not set(PHI3_NAMED_TOKENS) <= set(tokens):
        return re.sub("(?i)phi-?3", "p3", name)
    return name


def export_gguf(checkpoint: str | Path, out: str | Path, dtype: str = "f16") -> Path:
    checkpoint, out = Path(checkpoint), Path(out)
    if dtype not in FILE_TYPES:
        raise CheckpointError(f"--dtype {dtype!r}: choose one of {', '.join(FILE_TYPES)}")
    if not (checkpoint / "tokenizer.json").is_file():
        raise CheckpointError(f"{checkpoint} has no tokenizer.json; GGUF files carry the "
                              "vocabulary, so export a checkpoint that has one")
    model = load_checkpoint(checkpoint, dtype=torch.float32)
    config = model.config
    refusal = unwritable(config)
    if refusal is not None:
        raise CheckpointError(f"{checkpoint}: {refusal}")
    vocabulary = gguf_vocabulary(checkpoint, config.vocab_size, config.family)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), ARCHES[config.family])
    writer.add_name(_model_name(checkpoint.resolve().name, vocabulary.tokens))
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.dim)
    writer.add_block_count(config.n_layers)
    widths = [config.ffn_width(i) for i in range(config.n_layers)]
    writer.add_feed_forward_length(widths if config.double_wide_shared_mlp
                                   else config.ffn_hidden_dim)
    writer.add_head_count(config.n_heads)
    if config.family == "gemma4_text":
        _write_gemma4_layers(writer, config)
    else:
        writer.add_head_count_kv(config.n_kv_heads)
        writer.add_rope_dimension_count(config.rotary_dim)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if config.linear_layer_count:
        _write_delta_net_layers(writer, config)
    writer.add_rope_freq_base(config.rope_theta)
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling.factor)
    elif scaling is not None and scaling.rope_type == "longrope":
        writer.add_rope_scaling_orig_ctx_len(scaling.original_max_seq_len)
        writer.add_rope_scaling_attn_factors(scaling.cos_sin_scale())
    elif scaling is not None and scaling.rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling.factor)
        writer.add_rope_scaling_orig_ctx_len(scaling.original_max_seq_len)
        writer.add_rope_scaling_yarn_beta_fast(scaling.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(scaling.beta_slow)
        # llama.cpp scales cos/sin by this times its own 1 + 0.1 ln(factor)
        writer.add_rope_scaling_attn_factors(
            scaling.cos_sin_scale() / (1 + 0.1 * math.log(scaling.factor)))
    writer.add_layer_norm_rms_eps(config.norm_eps)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    if config.attn_softcap is not None:
        writer.add_attn_logit_softcapping(config.attn_softcap)
    if config.final_softcap is not None:
        writer.add_final_logit_softcapping(config.final_softcap)
    if config.n_experts:
        writer.add_expert_count(config.n_experts)
        writer.add_expert_used_count(config.n_experts_per_token)
        writer.add_expert_feed_forward_length(config.moe_ffn_hidden_dim)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        if config.shared_expert_dim and not config.experts_beside_mlp:
            writer.add_expert_shared_feed_forward_length(config.shared_expert_dim)
    if config.sigmoid_router:  # GLM-4.5's keys, as its config.json has them
        hf = config.to_hf_config()
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_shared_count(hf["n_shared_experts"])
        writer.add_leading_dense_block_count(hf["first_k_dense_replace"])
        writer.add_nextn_predict_layers(hf["num_nextn_predict_layers"])
        if config.topk_expert_groups < config.n_expert_groups:
            writer.add_expert_group_count(config.n_expert_groups)
            writer.add_expert_group_used_count(config.topk_expert_groups)
    if config.clip_qkv is not None:
        writer.add_clamp_kqv(config.clip_qkv)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(FILE_TYPES[dtype])
    vocabulary.write(writer)
    # named templates as llama.cpp's converter writes them: the default one, and each other
    # under tokenizer.chat_template.NAME
    if (templates := checkpoint_chat_templates(checkpoint)) is not None:
        writer.add_chat_template(templates)

    for name, array in gguf_tensors(model.state_dict(), config).items():
        # q8_0 rounds rows in blocks of 32 (narrower ones stay f16, as llama.cpp's converter)
        if dtype in ROUNDED and array.ndim == 2 and (dtype != "q8_0" or array.shape[1] % 32 == 0):
            kind = ROUNDED[dtype]
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        elif array.ndim == 1 or dtype == "f32":
            writer.add_tensor(name, array.astype(np.float32))  # norms stay f32, as llama.cpp
        else:
            writer.add_tensor(name, array.astype(np.float16))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    tmp.replace(out)
    return out
