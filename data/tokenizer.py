"""BPE tokenizer training (`lathe tokenizer train`): byte-level BPE with HF `tokenizers`,
a GPT-4-style split regex (digit groups of 1..max_digits), lathe's chat special tokens
and chat template, and a compression report (bytes per token on held-out documents).

The folder written is what a checkpoint carries: `tokenizer.json`,
`tokenizer_config.json` (special tokens and the Jinja chat template, readable by
`transformers.AutoTokenizer`), `special_tokens_map.json` and `tokenizer_report.json`.
"""

from __future__ import annotations

import itertools
import json
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from lathe.core.atomic import atomic_directory
from lathe.core.checkpoint_files import checkpoint_file
from lathe.core.errors import CheckpointError, ConfigError
from lathe.data.chat import BOS, CHAT_TEMPLATE, END_OF_TURN, PAD, SPECIAL_TOKENS

REPORT_FILE = "tokenizer_report.json"


def split_pattern(max_digits: int = 3) -> str:
    """GPT-4's (cl100k) pre-tokenization regex with numbers split into groups of at most
    `max_digits` digits, so "2026" is "202" + "6" rather than one rare token."""
    if not 1 <= max_digits <= 9:
        raise ConfigError(f"--max-digits={max_digits} must be between 1 and 9")
    return (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1," + str(max_digits)
            + r"}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def is_heldout(text: str, fraction: float) -> bool:
    """A stable, content-keyed split: the same document is held out on every run."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) % 10_000 < fraction * 10_000


def train_tokenizer(texts: Iterable[str], vocab_size: int, max_digits: int = 3,
                    show_progress: bool = True) -> Tokenizer:
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ConfigError(f"--vocab-size={vocab_size} is too small: byte-level BPE needs the "
                          f"256 byte tokens and {len(SPECIAL_TOKENS)} special tokens "
                          f"(at least {minimum})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_pattern(max_digits)), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=show_progress)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def compression(tokenizer: Tokenizer, texts: Iterable[str]) -> dict[str, float]:
    n_bytes = n_tokens = 0
    texts = iter(texts)
    while batch := list(itertools.islice(texts, 256)):
        n_bytes += sum(len(t.encode("utf-8", "surrogatepass")) for t in batch)
        n_tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch,
                                                                   add_special_tokens=False))
    return {"bytes": n_bytes, "tokens": n_tokens,
            "bytes_per_token": round(n_bytes / n_tokens, 4) if n_tokens else 0.0}


def load_tokenizer(folder: str | Path) -> Tokenizer:
    """The `tokenizer.json` of a tokenizer or checkpoint folder (a link in it is followed
    only as `checkpoint_file` allows); one that does not load is a `CheckpointError`."""
    file = checkpoint_file(folder, "tokenizer.json")
    if not file.is_file():
        raise ConfigError(f"{folder} has no tokenizer.json; point at a folder written by "
                          "`lathe tokenizer train` (or a checkpoint that carries one)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # the Rust loader raises a bare Exception
        raise CheckpointError(f"{file}: not a tokenizer the `tokenizers` library loads "
                              f"({error}); copy it again from the tokenizer folder") from None


def vocabulary_difference(a: Tokenizer, b: Tokenizer) -> list[tuple[str, int]]:
    """Up to three (token, id) entries in one vocabulary and not the other; [] when the two
    tokenizers map every token to the same id (a teacher and student, or a target and its
    draft, need that)."""
    first, second = a.get_vocab(with_added_tokens=True), b.get_vocab(with_added_tokens=True)
    return sorted(set(first.items()) ^ set(second.items()))[:3]


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens), for bits per byte.

    In byte-level BPE every character of a token's string is one byte of the text.
    """
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    lengths = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        lengths[token_id] = 0 if token in special else len(token)
    return lengths


def save_tokenizer(tokenizer: Tokenizer, folder: str | Path,
                   report: dict[str, Any] | None = None) -> None:
    with atomic_directory(folder) as tmp:
        tokenizer.save(str(tmp / "tokenizer.json"))
        specials = {"bos_token": BOS, "eos_token": END_OF_TURN, "pad_token": PAD}
        (tmp / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in specials.values()],
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": False,
            "model_input_names": ["input_ids", "attention_mask"],
        }, indent=2) + "\n")
        (tmp / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
        if report is not None:
            (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")


def train_from_folder(input_dir: str | Path, output: str | Path, vocab_size: int,
                      max_digits: int = 3, heldout_fraction: float = 0.05,
                      show_progress: bool = True) -> dict[str, Any]:
    """Train on a `lathe clean` output folder, hold out a split, save, return the report."""
    from lathe.data.store import iter_texts

    if not 0 <= heldout_fraction < 1:
        raise ConfigError(f"--heldout-fraction={heldout_fraction} must be in [0, 1)")

    def split(heldout: bool) -> Iterator[str]:
        return (t for t in iter_texts(input_dir) if is_heldout(t, heldout_fraction) == heldout)

    start = time.perf_counter()
    tokenizer = train_tokenizer(split(False), vocab_size, max_digits, show_progress)
    seconds = time.perf_counter() - start
    report = {"vocab_size": tokenizer.get_vocab_size(), "requested_vocab_size": vocab_size,
              "max_digits": max_digits, "train_seconds": round(seconds, 2),
              "heldout_fraction": heldout_fraction, "input": str(input_dir),
              "heldout": compression(tokenizer, split(True))}
    save_tokenizer(tokenizer, output, report)
    return report
