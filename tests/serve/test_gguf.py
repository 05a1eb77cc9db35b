"""GGUF export checked by an independent llama.cpp-style forward over the file's tensors.

The reference below reads only the GGUF file (names, shapes, dequantized data) and rotates
adjacent pairs as llama.cpp does. Attention is sharpened (q scaled up) and inputs have
many tokens, so a wrong q/k layout — invisible at position 0 — changes the logits a lot.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from lathe.model import load_checkpoint, save_checkpoint
from lathe.serve.gguf_export import export_gguf
from tests import llama_cpp_runtime
from tests.builders import (
    CODE,
    MULTILINGUAL,
    build_byte_level_tokenizer,
    build_gemma4_tokenizer,
    build_qwen_tokenizer,
    build_sentencepiece_tokenizer,
    split_then_bytes,
    syllable_text,
    tiny_model,
)


def read_gguf(path):
    reader = gguf.GGUFReader(str(path))
    tensors = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = torch.from_numpy(np.array(data, dtype=np.float32))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    return fields, tensors


def rope_adjacent(x: torch.Tensor, theta: float) -> torch.Tensor:
    """(T, H, D): rotate pairs (2i, 2i+1) by position * theta^(-2i/D), as llama.cpp."""
    seq, _, dim = x.shape
    freqs = theta ** (-torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(seq).float()[:, None] * freqs  # (T, D/2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def gguf_forward(fields, w, ids: list[int]) -> torch.Tensor:
    n_layers = fields["llama.block_count"]
    n_heads, n_kv = fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"]
    eps, theta = fields["llama.attention.layer_norm_rms_epsilon"], fields["llama.rope.freq_base"]

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    x = w["token_embd.weight"][ids]
    seq = len(ids)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for i in range(n_layers):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "attn_q.weight"].T).view(seq, n_heads, -1)
        k = (h @ w[p + "attn_k.weight"].T).view(seq, n_kv, -1)
        v = (h @ w[p + "attn_v.weight"].T).view(seq, n_kv, -1)
        q, k = rope_adjacent(q, theta), rope_adjacent(k, theta)
        k, v = (t.repeat_interleave(n_heads // n_kv, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        mixed = torch.einsum("hqk,khd->qhd", attn, v).reshape(seq, -1)
        x = x + mixed @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(h @ w[p + "ffn_gate.weight"].T)
        x = x + (gate * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    head = w.get("output.weight", w["token_embd.weight"])
    return norm(x, w["output_norm.weight"]) @ head.T


@torch.no_grad()
def with_gguf_weights(model, tensors):
    """`model` given the file's (dequantized) linear and embedding weights, q/k un-permuted;
    each stays within 1% of the original."""
    config = model.config
    for i, layer in enumerate(model.model.layers):
        attn, mlp, p = layer.self_attn, layer.mlp, f"blk.{i}."
        for linear, name, heads in ((attn.q_proj, "attn_q", config.n_heads),
                                    (attn.k_proj, "attn_k", config.n_kv_heads),
                                    (attn.v_proj, "attn_v", None),
                                    (attn.o_proj, "attn_output", None),
                                    (mlp.gate_proj, "ffn_gate", None),
                                    (mlp.up_proj, "ffn_up", None),
                                    (mlp.down_proj, "ffn_down", None)):
            weight = tensors[p + name + ".weight"]
            weight = unpermute(weight, heads) if heads else weight
            assert (weight - linear.weight).norm() / linear.weight.norm() < 0.01, name
            linear.weight.copy_(weight)
    model.model.embed_tokens.weight.copy_(tensors["token_embd.weight"])
    return model


@pytest.fixture(scope="module")
def sharpened(checkpoint, tmp_path_factory):
    """The tiny checkpoint with q scaled up (peaked attention), weights rounded to f16."""
    model = load_checkpoint(checkpoint)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
        for p in model.parameters():
            p.copy_(p.half().float())
    return save_checkpoint(model, tmp_path_factory.mktemp("gguf") / "sharp",
                           tokenizer=checkpoint), model


def unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Adjacent-pair rows back to rotate-half rows (the inverse of llama.cpp's permute)."""
    out, inp = weight.shape
    return weight.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_gguf_logits_match_lathe_on_many_tokens(sharpened, tmp_path, dtype):
    """The reference forward over the file equals lathe's forward on the same weights
    (for bf16 and q8_0: lathe given the file's rounded weights, which stay within 1% of the
    originals), to 2e-4 of the largest logit; llama.cpp's, to its rounding."""
    path, model = sharpened
    out = export_gguf(path, tmp_path / f"model-{dtype}.gguf", dtype=dtype)
    fields, tensors = read_gguf(out)
    if dtype in ("bf16", "q8_0"):
        model = with_gguf_weights(load_checkpoint(path), tensors)
    ids = torch.randint(0, model.config.vocab_size, (24,),
                        generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(ids[None]).logits[0]
        got = gguf_forward(fields, tensors, ids.tolist())
    scale = expected.abs().max()
    assert (got - expected).abs().max() / scale < (1e-5 if dtype == "f32" else 2e-4)
    kinds = {t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    if dtype in ("f32", "bf16"):
        assert kinds == {gguf.GGMLQuantizationType.F32, *(
            [gguf.GGMLQuantizationType.BF16] if dtype == "bf16" else [])}
    if dtype == "f16":
        # the same forward on un-permuted q/k (HF layout read as llama.cpp's) is far off
        wrong = dict(tensors)
        for i in range(model.config.n_layers):
            wrong[f"blk.{i}.attn_q.weight"] = model.model.layers[i].self_attn.q_proj.weight
            wrong[f"blk.{i}.attn_k.weight"] = model.model.layers[i].self_attn.k_proj.weight
        with torch.inference_mode():
            off = gguf_forward(fields, wrong, ids.tolist())
        assert (off - expected).abs().max() / scale > 1e-2
    # and llama.cpp runs the file: exactly in f32; past it, its matmuls round the
    # activations to the weights' type too (f16, bf16, 8-bit blocks)
    theirs = llama_cpp_runtime.LlamaCpp(out, 32).logits(ids.tolist())
    assert (theirs - expected).abs().max() / scale < {
        "f32": 1e-5, "f16": 1e-2, "bf16": 5e-2, "q8_0": 6e-2}[dtype]


def test_gguf_carries_hyperparameters_vocabulary_and_special_tokens(checkpoint, tmp_path):
    # into a folder that does not exist yet, as `lathe export --out new/m.gguf` asks
    fields, tensors = read_gguf(export_gguf(checkpoint, tmp_path / "new" / "m.gguf"))
    model = load_checkpoint(checkpoint)
    config = model.config
    assert fields["general.architecture"] == "llama"
    assert fields["llama.block_count"] == config.n_layers
    assert fields["llama.embedding_length"] == config.dim
    assert fields["llama.attention.head_count_kv"] == config.n_kv_heads
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "llama-bpe"
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens) == config.vocab_size and "<|end_of_turn|>" in tokens
    eos = fields["tokenizer.ggml.eos_token_id"]
    assert tokens[eos] == "<|end_of_turn|>"
    assert fields["tokenizer.ggml.token_type"][eos] == gguf.TokenType.CONTROL
    assert len(fields["tokenizer.ggml.merges"]) > 100
    assert "<|assistant|>" in fields["tokenizer.chat_template"]
    assert "output.weight" not in tensors  # tied to token_embd
    assert tensors["blk.0.attn_norm.weight"].dtype == torch.float32


def test_named_chat_templates_are_written_as_llama_cpps_converter_writes_them(checkpoint,
                                                                             tmp_path):
    """transformers' named templates (Hermes 3's default and tool_use): the default as
    tokenizer.chat_template, each other as tokenizer.chat_template.NAME, listed — and
    llama.cpp reads each by its name."""
    import shutil
    folder = shutil.copytree(checkpoint, tmp_path / "named")
    config_file = folder / "tokenizer_config.json"
    named = [{"name": "default", "template": "{{ messages[0].content }}"},
             {"name": "tool_use", "template": "{{ tools | length }}"}]
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "chat_template": named}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    fields, _ = read_gguf(export_gguf(folder, tmp_path / "m.gguf"))
    assert fields["tokenizer.chat_template"] == "{{ messages[0].content }}"
    assert fields["tokenizer.chat_template.tool_use"] == "{{ tools | length }}"
    assert fields["tokenizer.chat_templates"] == ["tool_use"]
    reference = llama_cpp_runtime.LlamaCpp(tmp_path / "m.gguf")
    assert reference.chat_template() == "{{ messages[0].content }}"
    assert reference.chat_template("tool_use") == "{{ tools | length }}"


def test_pre_tokenizer_names_follow_the_digit_grouping(tmp_path):
    """lathe's regex with 3-digit groups is Llama 3's, with single digits Qwen2's (spelled
    `\\p{N}{1,1}`, read as Qwen's `\\p{N}`); any other grouping has no llama.cpp name and
    is refused rather than split differently there."""
    from lathe.data.tokenizer import save_tokenizer, train_tokenizer
    from lathe.model import CheckpointError
    from lathe.serve.gguf_vocab import gguf_vocabulary
    texts = ["x = 12345 + 678", "def f(): return 42"] * 20
    for digits, name in ((3, "llama-bpe"), (1, "qwen2")):
        save_tokenizer(train_tokenizer(texts, 300, max_digits=digits, show_progress=False),
                       tmp_path / str(digits))
        assert gguf_vocabulary(tmp_path / str(digits), 300, "llama").pre == name
    assert gguf_vocabulary(tmp_path / "3", 300, "glm4_moe").pre == "glm4"
    save_tokenizer(train_tokenizer(texts, 300, max_digits=2, show_progress=False), tmp_path / "2")
    with pytest.raises(CheckpointError, match=r"is not one llama.cpp knows"):
        gguf_vocabulary(tmp_path / "2", 300, "llama")


def exported_with(tokenizer_folder, tmp_path, generation: dict, **model):
    """A tiny model (`model`: its config's overrides) with `tokenizer_folder`'s tokenizer
    and `generation` as its generation_config.json, exported to GGUF (f32)."""
    folder = save_checkpoint(tiny_model(**{"vocab_size": 512, **model}), tmp_path / "ck",
                             tokenizer=tokenizer_folder)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder, export_gguf(folder, tmp_path / "m.gguf", dtype="f32")


def test_a_sentencepiece_vocabulary_is_written_as_llamas_with_scores_bytes_and_end_ids(
        tmp_path):
    """Llama 2's, Mistral's and Gemma's shape: the `llama` tokenizer model, each piece scored
    by the rank of the merge that makes it, byte pieces typed BYTE, "▁" prepended, BOS
    added as the tokenizer adds it, and both end ids of the generation config (eos, eot)."""
    from tokenizers import Tokenizer
    tok = build_sentencepiece_tokenizer(tmp_path / "tok")
    turn_end = Tokenizer.from_file(str(tok / "tokenizer.json")).token_to_id("<end_of_turn>")
    _, out = exported_with(tok, tmp_path, {"bos_token_id": 1, "eos_token_id": [2, turn_end]})
    fields, _ = read_gguf(out)
    hf = json.loads((tok / "tokenizer.json").read_text())
    assert fields["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.pre" not in fields
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    scores = fields["tokenizer.ggml.scores"]
    assert tokens[3] == "<0x00>" and types[3] == gguf.TokenType.BYTE
    assert (types[0], types[1], types[turn_end]) == (
        gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL)
    first, second = ("".join(m) for m in hf["model"]["merges"][:2])  # (left, right) pairs
    assert scores[tokens.index(first)] == 0 and scores[tokens.index(second)] == -1
    assert fields["tokenizer.ggml.add_space_prefix"] and fields["tokenizer.ggml.add_bos_token"]
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"],
            fields["tokenizer.ggml.eot_token_id"], fields["tokenizer.ggml.unknown_token_id"]
            ) == (1, 2, turn_end, 0)


def test_gemma4s_vocabulary_is_llama_cpps_gemma4_model_and_tokenizes_as_hf(tmp_path):
    """Gemma 4's tokenizer has more merges than pieces, so llama.cpp must merge by their
    rank (its `gemma4` model, the merges written) to split text as HF does; written as the
    `llama` model, with a score per piece, the same tokenizer splits some texts otherwise
    (the control: what the export wrote for Gemma 4 before)."""
    from tokenizers import Tokenizer
    tok = build_gemma4_tokenizer(tmp_path / "tok")
    hf = Tokenizer.from_file(str(tok / "tokenizer.json"))
    size = hf.get_vocab_size()
    _, out = exported_with(tok, tmp_path, {"eos_token_id": [1, hf.token_to_id("<turn|>")]},
                           family="gemma4_text", n_layers=2, vocab_size=size)
    fields, _ = read_gguf(out)
    merges = json.loads((tok / "tokenizer.json").read_text())["model"]["merges"]
    assert len(merges) > size - 261  # several merges make one piece
    assert fields["tokenizer.ggml.model"] == "gemma4" and "tokenizer.ggml.scores" not in fields
    assert fields["tokenizer.ggml.merges"] == [" ".join(m) for m in merges]
    texts = syllable_text(60, seed=1) + [MULTILINGUAL, CODE, "a\n\n\nb  c   d\n", "  lead",
                                         "trail  ", "unseen: ∑ ж ß → ok"]
    reference = llama_cpp_runtime.LlamaCpp(out)
    for text in texts:
        ids = hf.encode(text).ids
        assert reference.tokenize(text) == ids, text
        assert reference.detokenize(ids[1:]) == hf.decode(ids[1:]) == text
    _, scored = exported_with(tok, tmp_path / "scored", {"eos_token_id": 1}, vocab_size=size)
    as_scores = llama_cpp_runtime.LlamaCpp(scored)
    assert sum(as_scores.tokenize(t) != hf.encode(t).ids for t in texts) >= 10


def test_a_gemma4_tokenizer_that_prepends_a_space_is_refused(tmp_path):
    """llama.cpp's `gemma4` model puts no "▁" before the text, so a tokenizer that does would
    have every text split otherwise there: refused, naming why."""
    from lathe.model import CheckpointError
    tok = build_sentencepiece_tokenizer(tmp_path / "tok")  # prepends
    with pytest.raises(CheckpointError, match="puts '▁' before the text"):
        exported_with(tok, tmp_path, {"eos_token_id": 2}, family="gemma4_text", n_layers=2)


def test_gemma4s_markers_read_as_tokens_and_show_in_llama_cpps_text(tmp_path):
    """Gemma 4's turn, tool-call, quote and channel markers are special tokens: llama.cpp
    parses a rendered call's markers into HF's ids, and shows the ones its chat parser reads
    (calls, quotes, the thought channel) in the text of generated ids, as HF does with
    special tokens kept; the turn's end stays hidden, and ends generation."""
    from tokenizers import Tokenizer
    tok = build_gemma4_tokenizer(tmp_path / "tok", specials=(
        "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>",
        "<channel|>", "<|tool_response>"))
    hf = Tokenizer.from_file(str(tok / "tokenizer.json"))
    end = hf.token_to_id("<turn|>")
    _, out = exported_with(tok, tmp_path, {"eos_token_id": [end]}, family="gemma4_text",
                           n_layers=2, vocab_size=hf.get_vocab_size())
    reference = llama_cpp_runtime.LlamaCpp(out)
    reply = '<|channel>thought\nadd<channel|><|tool_call>call:add{a:2,s:<|"|>hi<|"|>}<tool_call|>'
    assert reference.tokenize(reply, special=True) == hf.encode(reply).ids  # after a BOS
    ids = hf.encode(reply, add_special_tokens=False).ids
    assert reference.detokenize(ids) == hf.decode(ids, skip_special_tokens=False) == reply
    turn = hf.encode("<|turn>model\nok<turn|>", add_special_tokens=False).ids
    assert reference.detokenize(turn) == "model\nok" and reference.is_end(end)


def test_a_qwen_vocabulary_names_qwens_pre_tokenizer_and_every_end_id(tmp_path):
    """Qwen's regex spelled as Qwen spells it is `qwen2` (it was `default`, so llama.cpp split
    code and newlines differently); its two end ids (<|im_end|>, <|endoftext|>) are eos and
    eot (a GGUF with no EOS made llama.cpp stop on token 11); more than three are refused."""
    from tokenizers import Tokenizer
    tok = build_qwen_tokenizer(tmp_path / "tok")
    ids = Tokenizer.from_file(str(tok / "tokenizer.json"))
    im_end, text_end = ids.token_to_id("<|im_end|>"), ids.token_to_id("<|endoftext|>")
    _, out = exported_with(tok, tmp_path, {"eos_token_id": [text_end, im_end]})
    fields, _ = read_gguf(out)
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "qwen2")
    assert (fields["tokenizer.ggml.eos_token_id"], fields["tokenizer.ggml.eot_token_id"]) == (
        im_end, text_end)  # the tokenizer's eos_token first
    assert fields["tokenizer.ggml.token_type"][ids.token_to_id("<tool_call>")] == \
        gguf.TokenType.USER_DEFINED
    assert not fields["tokenizer.ggml.add_bos_token"]
    from lathe.model import CheckpointError
    with pytest.raises(CheckpointError, match="4 end-of-sequence ids"):
        exported_with(tok, tmp_path / "many", {"eos_token_id": [text_end, im_end, 5, 6]})


def lathe_tokenizer(folder, max_digits: int):
    """lathe's own tokenizer, as `lathe tokenizer train` writes it (its chat specials)."""
    from lathe.data.tokenizer import save_tokenizer, train_tokenizer
    texts = [MULTILINGUAL, CODE, "x = 12345 + 678; print(x)"] * 20
    save_tokenizer(train_tokenizer(texts, 400, max_digits=max_digits, show_progress=False),
                   folder)
    return folder


def tekken_tokenizer(folder):
    """Mistral's Tekken (Mistral Nemo, Small 3.x): byte-level BPE behind its case-aware split,
    a BOS added, [INST] and [TOOL_CALLS] as specials."""
    from lathe.serve.gguf_vocab import TEKKEN_REGEX
    return build_byte_level_tokenizer(
        folder, split_then_bytes(TEKKEN_REGEX),
        ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]"], [],
        {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}, bos="<s>")


TOKENIZER_SHAPES = {  # builder, end tokens, a turn rendered in its special tokens
    "llama2": (lambda folder: build_sentencepiece_tokenizer(folder, prepend=True),
               ["</s>", "<end_of_turn>"], "[INST] hi there [/INST] Sure: ∑ ok</s><end_of_turn>\n"),
    "gemma": (lambda folder: build_sentencepiece_tokenizer(folder, prepend=False),
              ["</s>", "<end_of_turn>"], "<end_of_turn>\nuser says: café 東京<end_of_turn>\n"),
    "qwen": (build_qwen_tokenizer, ["<|im_end|>", "<|endoftext|>"],
             "<|im_start|>user\nadd 2 and 3<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
             '{"name": "add", "arguments": {"a": 2}}<|im_end|><|endoftext|>'),
    "tekken": (tekken_tokenizer, ["</s>"],
               "[INST] add 2 and 3[/INST][TOOL_CALLS] [{\"name\": \"add\"}]</s>"),
    "gpt-2": (lambda folder: build_byte_level_tokenizer(
        folder, pre_tokenizers.ByteLevel(add_prefix_space=False), ["<|endoftext|>"], [],
        {"eos_token": "<|endoftext|>"}), ["<|endoftext|>"], "12345 apples<|endoftext|>"),
    "smollm": (lambda folder: build_byte_level_tokenizer(
        folder, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                         pre_tokenizers.ByteLevel(add_prefix_space=False)]),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], [], {"eos_token": "<|im_end|>"}),
               ["<|im_end|>"], "<|im_start|>user\n12345 + 678<|im_end|>\n"),
    "lathe": (lambda folder: lathe_tokenizer(folder, 1), ["<|end_of_turn|>"],
              "<|begin_of_text|><|user|>\nadd 12 and 345<|end_of_turn|><|assistant|>\n357"),
    "lathe-3-digits": (lambda folder: lathe_tokenizer(folder, 3), ["<|end_of_turn|>"],
                       "<|begin_of_text|><|user|>\n12345 + 678<|end_of_turn|>"),
}


@pytest.mark.parametrize("shape", TOKENIZER_SHAPES)
def test_llama_cpp_tokenizes_and_detokenizes_the_export_as_hf_does(shape, tmp_path):
    """The file's text, not only its ids, in llama.cpp itself: its tokenizer splits a
    multilingual text, code and characters the vocabulary lacks (byte fallback) into HF's
    ids, and a rendered chat's special and added tokens (parsed as llama-server parses a
    prompt) too; it turns generated ids back into HF's text, special tokens shown or not;
    and it stops on every end id of the generation config — for SentencePiece with a
    prepended "▁" (Llama 2, Mistral) and without (Gemma), the byte-level BPEs behind Qwen's,
    Tekken's, GPT-2's and SmolLM's splits, and lathe's own (digits one by one, read as
    qwen2's split; in threes, as Llama 3's)."""
    from tokenizers import Tokenizer
    build, end_tokens, chat_text = TOKENIZER_SHAPES[shape]
    tok = build(tmp_path / "tok")
    hf = Tokenizer.from_file(str(tok / "tokenizer.json"))
    ends = [hf.token_to_id(token) for token in end_tokens]
    _, out = exported_with(tok, tmp_path, {"eos_token_id": ends})
    reference = llama_cpp_runtime.LlamaCpp(out)
    bos = hf.token_to_id("<s>")

    def generated(ids):  # a completion: the ids after the prompt's BOS
        return ids[1:] if ids[0] == bos else ids

    for text in (MULTILINGUAL, CODE, "unseen: ∑ ж ß → ok"):
        ids = hf.encode(text).ids
        assert reference.tokenize(text) == ids, text
        assert reference.detokenize(generated(ids)) == hf.decode(generated(ids)), text
    chat = hf.encode(chat_text).ids
    assert reference.tokenize(chat_text, special=True) == chat
    assert reference.detokenize(generated(chat), special=True) == hf.decode(
        generated(chat), skip_special_tokens=False)
    assert reference.detokenize(generated(chat)) == hf.decode(generated(chat))
    assert [reference.is_end(i) for i in ends] == [True] * len(ends)
    assert not any(reference.is_end(i) for i in hf.encode(CODE).ids)
