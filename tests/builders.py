"""Small seeded things tests build: models and tokenizers; and a fresh accelerate state."""

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lathe.model import ModelConfig, Transformer


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state, so the next run builds its own Accelerator
    (with its own mixed precision) as a fresh process would."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def tiny_model(**overrides) -> Transformer:
    """A seeded model from the tiny preset, with overrides (fp32, eval mode)."""
    config = ModelConfig.from_preset("tiny", **{"vocab_size": 256, "max_seq_len": 128,
                                                **overrides})
    torch.manual_seed(0)
    return Transformer(config).eval()


GEMMA4 = {"family": "gemma4_text", "n_layers": 3, "global_k_is_v": True,
          "global_n_kv_heads": 1}  # full layers wider, with one KV head and no v_proj
# E2B's: per-layer inputs, the last two layers (one sliding, one full) attending over the keys
# and values of layers 2 and 3, with MLPs twice as wide
GEMMA4_E2B = {**GEMMA4, "n_layers": 6, "sliding_window": 8,
              "layer_types": ["sliding_attention", "full_attention"] * 3, "per_layer_dim": 16,
              "kv_shared_layers": 2, "double_wide_shared_mlp": True}


def serve_model(vocab_size: int = 512, **overrides) -> Transformer:
    """Two tiny layers at the preset's 256 positions, with a larger init so that greedy
    argmaxes are not near-ties."""
    return tiny_model(**{"vocab_size": vocab_size, "n_layers": 2, "init_std": 0.08,
                         "max_seq_len": 256, **overrides})


def build_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    """A small byte-level BPE with chat special tokens, written as an HF tokenizer folder."""
    specials = ["<|begin_of_text|>", "<|end_of_turn|>", "<|pad|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog", "hello world", "def f(x): return x"]
    tokenizer.train_from_iterator(text * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials[0], "eos_token": specials[1], "pad_token": specials[2],
    }))
    return folder


# text in several scripts, code and odd spacing: what a tokenizer must round-trip
MULTILINGUAL = ("Hello world, this is a test.\nÉtudiant naïve café — 東京タワー 北京 "
                "Привет мир! مرحبا 🙂🚀  tabs\tand   spaces\n\n")
CODE = "def add(a, b):\n    return a + b  # 12345 + 678\n\nprint(add(1, 2))\n"
_CORPUS = [MULTILINGUAL, CODE, "the quick brown fox jumps over the lazy dog",
           "numbers 2026 and 3.14159", "Élan vital, über alles, señor"]


def build_sentencepiece_tokenizer(folder: Path, end_of_turn: str = "<end_of_turn>",
                                  prepend: bool = True) -> Path:
    """The shape of Llama 2's, Mistral's and Gemma's tokenizer.json: BPE over "▁"-spaced
    pieces with `<0xNN>` byte fallback (ids 3-258, after <unk> <s> </s>), a "▁" prepended to
    the text (not by Gemma's: `prepend=False`), `add_bos_token` true, and an end-of-turn
    special after the pieces."""
    from tokenizers import normalizers, processors

    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, max_token_length=8)
    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                             normalizers.Replace(" ", "▁")])
    # trained on words, as SentencePiece splits on whitespace; the file has no pre-tokenizer
    draft.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    draft.train_from_iterator(_CORPUS * 10, trainer)
    trained = json.loads(draft.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(
        specials + [f"<0x{b:02X}>" for b in range(256)]
        + [t for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1])
           if t not in specials])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                                     fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁")] * prepend + [normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse()]
                                          + [decoders.Strip(" ", 1, 0)] * prepend)
    tokenizer.add_special_tokens(specials + [end_of_turn])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"}))
    return folder


def syllable_text(lines: int, seed: int = 0) -> list[str]:
    """Seeded lines of made-up words (Latin, accented, Cyrillic, CJK and emoji syllables):
    enough distinct text for a BPE of a thousand pieces."""
    import random
    rng = random.Random(seed)
    syllables = ["ka", "to", "ri", "an", "en", "the", "ing", "ion", "qu", "st", "pr", "ou",
                 "é", "ж", "東", "🙂"]
    return [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
                     for _ in range(20)) for _ in range(lines)]


def build_gemma4_tokenizer(folder: Path, specials: tuple[str, ...] = ("<|turn>", "<turn|>")
                           ) -> Path:
    """The shape of Gemma 4's tokenizer.json: a BPE over "▁"-spaced text with `<0xNN>` byte
    fallback (ids 5-260, after <pad> <eos> <bos> <unk> <mask>), no "▁" prepended, no split
    at spaces (merges join words), the pre-tokenizer transformers' GemmaTokenizer writes, a
    BOS added — and more merges than pieces: as in Gemma 4's (514,906 merges for 262,144
    pieces), several merges make the same piece, each at its own rank. `specials` follow
    the pieces."""
    import random

    from tokenizers import Regex, normalizers, processors

    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.normalizer = normalizers.Replace(" ", "▁")
    draft.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    draft.train_from_iterator(_CORPUS * 10 + syllable_text(400), trainers.BpeTrainer(
        vocab_size=1500, show_progress=False, max_token_length=12))
    trained = json.loads(draft.to_str())["model"]
    heads = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    vocab = {token: i for i, token in enumerate(
        heads + [f"<0x{b:02X}>" for b in range(256)]
        + [t for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1])
           if t not in heads])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    known, rng = set(merges), random.Random(0)
    for left, right in list(merges):
        joined = left + right
        for cut in range(1, len(joined)):
            other = (joined[:cut], joined[cut:])
            if other not in known and other[0] in vocab and other[1] in vocab:
                known.add(other)
                merges.insert(rng.randrange(len(merges) + 1), other)
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                                     fuse_unk=True))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                           decoders.Fuse()])
    tokenizer.add_special_tokens(heads + list(specials))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "bos_token": "<bos>",
        "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
        "mask_token": "<mask>"}))
    return folder


def build_byte_level_tokenizer(folder: Path, pre_tokenizer, specials: list[str],
                               added: list[str], config: dict, bos: str | None = None) -> Path:
    """A byte-level BPE (GPT-2's byte alphabet, its decoder) trained on the test corpus
    behind `pre_tokenizer`, with `specials` and `added` (non-special) tokens after the
    pieces, `config` as its tokenizer_config.json and `bos` prepended when given."""
    from tokenizers import processors
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS * 10, trainer)
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens(added)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokenizer.token_to_id(bos))])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def split_then_bytes(regex: str):
    """HF's pre-tokenizer for a split regex, as Qwen's, Llama 3's and Tekken's files spell it."""
    from tokenizers import Regex
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}"
              r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_qwen_tokenizer(folder: Path) -> Path:
    """The shape of Qwen2.5's and Qwen3's tokenizer.json: byte-level BPE behind Qwen's own
    regex (single digits, spelled `\\p{N}`), `<|endoftext|>`, `<|im_start|>` and
    `<|im_end|>` as specials and `<tool_call>` as an added non-special token; no BOS."""
    return build_byte_level_tokenizer(
        folder, split_then_bytes(QWEN_REGEX), ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        ["<tool_call>"], {"tokenizer_class": "Qwen2TokenizerFast", "add_bos_token": False,
                          "bos_token": None, "eos_token": "<|im_end|>",
                          "pad_token": "<|endoftext|>"})


def build_qwen3_5_tokenizer(folder: Path, vocab_size: int = 400) -> Path:
    """The shape of Qwen3.5's tokenizer.json: byte-level BPE behind its own split regex (Qwen2's
    keeping combining marks in words), with its chat special tokens after the pieces."""
    from tokenizers import Regex
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS * 10, trainer)
    tokenizer.add_special_tokens(specials)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None}))
    return folder
