"""A checkpoint as one GGUF file for llama.cpp (and Ollama, LM Studio), written with the
`gguf` package: llama hyper-parameters, the byte-level BPE vocabulary, merges, special
tokens and chat template, and every tensor under llama.cpp's name in f32 (the exact
weights, to compare runtimes on the same numbers), f16 or q8_0.

Two layout facts matter. llama.cpp's llama RoPE rotates adjacent pairs (2i, 2i + 1)
while HF checkpoints rotate halves (i, i + d/2), so q_proj and k_proj rows are permuted
per head (`permute_rope_rows`) — the same transform llama.cpp's own converter applies.
Llama-3 frequency scaling travels as `rope_freqs.weight`, the per-frequency divisors.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor

from lathe.data.chat_template import checkpoint_chat_template
from lathe.data.tokenizer import split_pattern
from lathe.model.checkpoint import CheckpointError, load_checkpoint
from lathe.model.config import ModelConfig
from lathe.model.transformer import rope_inv_freq

FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def permute_rope_rows(weight: Tensor, n_heads: int) -> Tensor:
    """Reorder each head's output rows from rotate-half to adjacent-pair RoPE layout."""
    out_features, in_features = weight.shape
    head_dim = out_features // n_heads
    return (weight.reshape(n_heads, 2, head_dim // 2, in_features).transpose(1, 2)
            .reshape(out_features, in_features))


def gguf_tensor_name(name: str) -> str:
    """llama.cpp's name for an HF Llama parameter name."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    _, _, index, rest = name.split(".", 3)
    module = rest.removesuffix(".weight")
    if module not in LAYER_NAMES:
        raise CheckpointError(f"no GGUF name for parameter {name}")
    return f"blk.{index}.{LAYER_NAMES[module]}.weight"


def gguf_tensors(state: dict[str, Tensor], config: ModelConfig) -> dict[str, np.ndarray]:
    """fp32 arrays under llama.cpp's names, q/k permuted, a tied LM head left out."""
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        tensor = tensor.detach().float().cpu()
        if name.endswith("q_proj.weight"):
            tensor = permute_rope_rows(tensor, config.n_heads)
        elif name.endswith("k_proj.weight"):
            tensor = permute_rope_rows(tensor, config.n_kv_heads)
        out[gguf_tensor_name(name)] = tensor.numpy()
    if config.rope_scaling is not None:
        plain = dataclasses.replace(config, rope_scaling=None)
        out["rope_freqs.weight"] = (rope_inv_freq(plain) / rope_inv_freq(config)).numpy()
    return out


def _vocabulary(checkpoint: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    data = json.loads((checkpoint / "tokenizer.json").read_text())
    by_id = {i: token for token, i in data["model"]["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in by_id}
    for added in data.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = (gguf.TokenType.CONTROL if added.get("special")
                              else gguf.TokenType.USER_DEFINED)
    tokens, token_types = [], []
    for i in range(vocab_size):  # the model's rows past the tokenizer's size stay unused
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        token_types.append(int(types.get(i, gguf.TokenType.UNUSED)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    return tokens, token_types, merges


def _pre_tokenizer(checkpoint: Path) -> str:
    """llama.cpp's name for the pre-tokenization regex: lathe's with numbers split in
    groups of up to 3 digits is Llama-3's ("llama-bpe"), one digit at a time is Qwen2's."""
    text = (checkpoint / "tokenizer.json").read_text()
    for digits, name in ((3, "llama-bpe"), (1, "qwen2")):
        if json.dumps(split_pattern(digits))[1:-1] in text:
            return name
    return "default"


def export_gguf(checkpoint: str | Path, out: str | Path, dtype: str = "f16") -> Path:
    checkpoint, out = Path(checkpoint), Path(out)
    if dtype not in FILE_TYPES:
        raise CheckpointError(f"--dtype {dtype!r}: choose one of {', '.join(FILE_TYPES)}")
    if not (checkpoint / "tokenizer.json").is_file():
        raise CheckpointError(f"{checkpoint} has no tokenizer.json; GGUF files carry the "
                              "vocabulary, so export a checkpoint that has one")
    model = load_checkpoint(checkpoint, dtype=torch.float32)
    config = model.config
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "yarn":
        raise CheckpointError(f"{checkpoint}: YaRN RoPE scaling is not written to GGUF yet")
    if config.family != "llama" or config.qkv_bias or config.q_dim != config.dim:
        raise CheckpointError(f"{checkpoint}: a {config.family} model"
                              f"{' with attention biases' if config.qkv_bias else ''}; the GGUF "
                              "export writes llama.cpp's plain llama architecture only so far")
    generation = json.loads((checkpoint / "generation_config.json").read_text()) \
        if (checkpoint / "generation_config.json").is_file() else {}

    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name(checkpoint.resolve().name)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.dim)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.ffn_hidden_dim)
    writer.add_head_count(config.n_heads)
    writer.add_head_count_kv(config.n_kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(FILE_TYPES[dtype])
    tokens, token_types, merges = _vocabulary(checkpoint, config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(checkpoint))
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    for role, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("pad", writer.add_pad_token_id)):
        token_id = generation.get(f"{role}_token_id")
        if isinstance(token_id, int):
            add(token_id)
    # lathe tokenizes as transformers does, adding no BOS: a template writes it if wanted
    writer.add_add_bos_token(False)
    if (template := checkpoint_chat_template(checkpoint)) is not None:
        writer.add_chat_template(template)

    for name, array in gguf_tensors(model.state_dict(), config).items():
        quantize = dtype == "q8_0" and array.ndim == 2 and array.shape[1] % 32 == 0
        if quantize:
            q8_0 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(array, q8_0), raw_dtype=q8_0)
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
