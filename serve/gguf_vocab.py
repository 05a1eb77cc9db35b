"""A checkpoint's tokenizer as llama.cpp reads one from a GGUF file: the vocabulary in the
form of its tokenizer model, the pre-tokenizer's name, the special ids (an instruct model's
end-of-turn ids included) and whether a BOS is added.

Two shapes of `tokenizer.json` are written, as llama.cpp's own converter writes them:
- byte-level BPE (GPT-2's byte alphabet: Llama 3, Qwen, GLM, SmolLM, lathe's own) as the
  `gpt2` model with its merges and the name of its pre-tokenization regex
  (`tokenizer.ggml.pre`), which llama.cpp hard-codes per name. The regex is read from the
  file and matched against the known ones (`PRE_TOKENIZERS`); one llama.cpp does not know
  would split text differently there, so it is refused.
- SentencePiece BPE (pieces with "▁" for spaces and `<0xNN>` byte fallback: Llama 2,
  Mistral, Gemma 1-3, Phi-3) as the `llama` model: pieces, a score each (llama.cpp merges the
  adjacent pair whose joined piece scores highest, so a piece scores minus the rank of the
  first merge that makes it) and token types (byte pieces BYTE), with `add_space_prefix`
  when the tokenizer prepends "▁".

Gemma 4's tokenizer is SentencePiece-shaped but a BPE by merge rank with more merges than
pieces (several merges make the same piece), which no score per piece reproduces: it is
written as llama.cpp's `gemma4` model (its converter's), the merges themselves over the
"▁"-spaced pieces, and llama.cpp merges by their rank as HF does.

Gemma 4's tool-call, reasoning and string-quote markers are special tokens that its files
type user-defined, as its converter does, so that llama.cpp shows them in text.

End ids: llama.cpp stops on `eos`, `eot` and `eom` (and on a few pieces it knows by name),
so a `generation_config.json` list of up to three ends goes there, the tokenizer's
`eos_token` as `eos`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from lathe.core.checkpoint_files import read_eos_ids, read_json_if_present, read_json_object
from lathe.model.checkpoint import CheckpointError

# HF's pre-tokenization regexes (as tokenizer.json spells them) and llama.cpp's name for each
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# Qwen3.5's: Qwen2's with combining marks kept in words
QWEN3_5_REGEX = QWEN2_REGEX.replace(r"?\p{L}+", r"?[\p{L}\p{M}]+").replace(
    r"[^\s\p{L}\p{N}]+", r"[^\s\p{L}\p{M}\p{N}]+")
TEKKEN_REGEX = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
                r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2 = "ByteLevel"  # no Split: ByteLevel's own regex (GPT-2's)
SMOLLM = "Digits+ByteLevel"  # each digit alone, then GPT-2's regex
PRE_TOKENIZERS = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2", TEKKEN_REGEX: "tekken",
                  GPT2: "gpt-2", SMOLLM: "smollm", QWEN3_5_REGEX: "qwen35"}
# families whose llama.cpp name for the Llama-3 regex is their own (it also drops the BOS)
FAMILY_PRE = {"glm4_moe": {"llama-bpe": "glm4"}}
# families whose "▁"-spaced BPE llama.cpp reads by merge rank, as its tokenizer model named
RANKED_SPM = {"gemma4_text": "gemma4"}
# special tokens a family's llama.cpp files show in text (user-defined, not control), as its
# converter writes them, so that llama-server's chat parser reads the calls and reasoning
VISIBLE = {"gemma4_text": {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>",
                           "<|tool_response>", "<tool_response|>", '<|"|>'}}
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
END_KINDS = ("eos", "eot", "eom")  # the end ids a GGUF file can name


@dataclass
class GGUFVocabulary:
    model: str  # "gpt2", "llama" or a RANKED_SPM model
    tokens: list[str]
    token_types: list[int]
    pre: str | None = None  # gpt2 only
    merges: list[str] = field(default_factory=list)  # gpt2 and RANKED_SPM
    scores: list[float] = field(default_factory=list)  # llama only
    add_space_prefix: bool = False  # llama only
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, eot, eom, unk, pad
    add_bos: bool = False

    def write(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        if self.merges:
            writer.add_token_merges(self.merges)
        if self.scores:
            writer.add_token_scores(self.scores)
            writer.add_add_space_prefix(self.add_space_prefix)
        for kind, token_id in self.special_ids.items():
            getattr(writer, f"add_{kind}_token_id")(token_id)
        writer.add_add_bos_token(self.add_bos)


def gguf_vocabulary(checkpoint: Path, vocab_size: int, family: str) -> GGUFVocabulary:
    """The checkpoint's tokenizer as llama.cpp's vocabulary, or a `CheckpointError` saying
    why llama.cpp would tokenize its text differently."""
    data = read_json_object(checkpoint / "tokenizer.json")
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise CheckpointError(f"{checkpoint / 'tokenizer.json'}: a {model.get('type')} "
                              "tokenizer; the GGUF export writes BPE vocabularies only")
    tokenizer_config = read_json_if_present(checkpoint / "tokenizer_config.json")
    pieces, types = _pieces(data, vocab_size)
    spm = bool(model.get("byte_fallback"))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ranked = RANKED_SPM.get(family) if spm else None
    vocabulary = GGUFVocabulary(model=ranked or ("llama" if spm else "gpt2"), tokens=pieces,
                                token_types=types)
    if ranked:
        vocabulary.merges = _ranked_merges(data, merges, checkpoint, ranked)
    elif spm:
        vocabulary.scores = _scores(pieces, merges)
        vocabulary.add_space_prefix = _prepends_space(data)
    if spm:
        vocabulary.token_types = [int(gguf.TokenType.BYTE) if BYTE_PIECE.fullmatch(piece)
                                  and kind == gguf.TokenType.NORMAL else kind
                                  for piece, kind in zip(pieces, types, strict=True)]
    else:
        vocabulary.merges = merges
        pre = _pre_tokenizer_name(data, checkpoint)
        vocabulary.pre = FAMILY_PRE.get(family, {}).get(pre, pre)
    shown = VISIBLE.get(family, set())
    vocabulary.token_types = [int(gguf.TokenType.USER_DEFINED) if piece in shown else kind
                              for piece, kind in zip(pieces, vocabulary.token_types,
                                                     strict=True)]
    vocabulary.special_ids = _special_ids(checkpoint, pieces, tokenizer_config, spm)
    vocabulary.add_bos = tokenizer_config.get("add_bos_token") is True
    return vocabulary


def _pieces(data: dict[str, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    """Every row's piece and type; rows past the tokenizer's size stay unused."""
    by_id = {i: token for token, i in data["model"]["vocab"].items()}
    types = dict.fromkeys(by_id, int(gguf.TokenType.NORMAL))
    for added in data.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = int(gguf.TokenType.CONTROL if added.get("special")
                                 else gguf.TokenType.USER_DEFINED)
    unk = data["model"].get("unk_token")
    if unk in data["model"]["vocab"]:
        types[data["model"]["vocab"][unk]] = int(gguf.TokenType.UNKNOWN)
    return ([by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)],
            [types.get(i, int(gguf.TokenType.UNUSED)) for i in range(vocab_size)])


def _scores(pieces: list[str], merges: list[str]) -> list[float]:
    """Minus the rank of the first merge that makes each piece; pieces no merge makes
    (characters, bytes, specials) score below every merge, so llama.cpp never joins two
    symbols into one of them where the BPE would not."""
    rank: dict[str, int] = {}
    for r, merge in enumerate(merges):
        left, _, right = merge.partition(" ")
        rank.setdefault(left + right, r)
    floor = -float(len(merges) + 1)
    return [-float(rank[piece]) if piece in rank else floor for piece in pieces]


def _ranked_merges(data: dict[str, Any], merges: list[str], checkpoint: Path,
                   model: str) -> list[str]:
    """`merges` as a GGUF file spells them ("left right"), for llama.cpp's `model`, which
    neither prepends "▁" to the text nor reads merges of pieces with a space in them."""
    if _prepends_space(data):
        raise CheckpointError(
            f"{checkpoint / 'tokenizer.json'}: this tokenizer puts '▁' before the text, "
            f"which llama.cpp's {model!r} tokenizer model (the family's) does not, so "
            "llama.cpp would tokenize every text differently; its tokenizer cannot be exported")
    for merge in merges:
        if merge.count(" ") != 1:
            raise CheckpointError(
                f"{checkpoint / 'tokenizer.json'}: merge {merge!r} joins a piece with a space "
                "in it, which a GGUF file's merges cannot spell (llama.cpp splits them at the "
                "space); its tokenizer cannot be exported")
    return merges


def _prepends_space(data: dict[str, Any]) -> bool:
    """Whether the tokenizer puts "▁" before the text (a Prepend normalizer, Llama 2's, or a
    Metaspace pre-tokenizer that prepends, Mistral's)."""
    def parts(node: dict[str, Any] | None) -> list[dict[str, Any]]:
        if not node:
            return []
        return node.get("normalizers") or node.get("pretokenizers") or [node]

    return (any(p.get("type") == "Prepend" for p in parts(data.get("normalizer")))
            or any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
                   for p in parts(data.get("pre_tokenizer"))))


def _pre_tokenizer_name(data: dict[str, Any], checkpoint: Path) -> str:
    node = data.get("pre_tokenizer") or {}
    steps = node.get("pretokenizers", [node]) if node.get("type") == "Sequence" else [node]
    kinds = [step.get("type") for step in steps]
    regexes = [step["pattern"].get("Regex") for step in steps if step.get("type") == "Split"]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        key = GPT2
    elif kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        key = SMOLLM
    elif len(regexes) == 1 and kinds == ["Split", "ByteLevel"] and regexes[0]:
        key = regexes[0].replace(r"\p{N}{1,1}", r"\p{N}")
    else:
        key = None
    if key not in PRE_TOKENIZERS:
        shown = regexes[0] if len(regexes) == 1 else " + ".join(str(k) for k in kinds)
        raise CheckpointError(
            f"{checkpoint / 'tokenizer.json'}: pre-tokenizer {shown!r} is not one llama.cpp "
            f"knows ({', '.join(sorted(PRE_TOKENIZERS.values()))}), so llama.cpp would split "
            "text differently from this tokenizer; a lathe tokenizer trained with "
            "--max-digits 1 or 3 exports")
    return PRE_TOKENIZERS[key]


def _special_ids(checkpoint: Path, pieces: list[str], tokenizer_config: dict[str, Any],
                 spm: bool) -> dict[str, int]:
    """bos, unk (SentencePiece) and pad from generation_config.json or config.json, the
    tokenizer's own tokens otherwise; the end ids (eos, eot, eom): generation_config.json's
    and the tokenizer's eos_token."""
    index = {piece: i for i, piece in enumerate(pieces)}

    def token_id(role: str) -> int | None:
        token = tokenizer_config.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        return index.get(token) if isinstance(token, str) else None

    generation = read_json_if_present(checkpoint / "generation_config.json")
    config = read_json_if_present(checkpoint / "config.json")
    ids: dict[str, int] = {}
    for role in ("bos", "pad") + (("unk",) if spm else ()):
        value = generation.get(f"{role}_token_id", config.get(f"{role}_token_id"))
        value = value if isinstance(value, int) else token_id(role)
        if isinstance(value, int) and 0 <= value < len(pieces):
            ids[role] = value
    ends = read_eos_ids(checkpoint, len(pieces))
    named = token_id("eos")
    if named is not None and named not in ends:
        ends.insert(0, named)
    ends = sorted(dict.fromkeys(ends), key=lambda i: i != named)  # the named eos first
    if len(ends) > len(END_KINDS):
        raise CheckpointError(
            f"{checkpoint}: {len(ends)} end-of-sequence ids {ends}; a GGUF file names at most "
            f"{len(END_KINDS)} (eos, eot, eom), so llama.cpp would not stop on the rest")
    ids.update(zip(END_KINDS, ends, strict=False))
    return ids

