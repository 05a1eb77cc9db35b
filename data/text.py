"""Text measurements shared by the quality filters and dedup: word, line and paragraph
splitting, duplicate counting and n-gram repetition, as defined by Gopher (Rae et al.
2021, table A1) and implemented the same way as datatrove so thresholds carry over."""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter

_WORD = re.compile(r"\w+|[^\w\s]+")
_PARAGRAPH_BREAK = re.compile(r"\n{2,}")
_LINE_BREAK = re.compile(r"\n+")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")
PUNCTUATION = frozenset(string.punctuation) | {"…", "“", "”", "‘", "’", "—", "–", "«", "»"}


def words(text: str) -> list[str]:
    """Word tokens: runs of word characters, and runs of punctuation as their own tokens
    (close to the nltk tokenizer datatrove uses, without its model)."""
    return _WORD.findall(text)


def is_symbol(word: str) -> bool:
    return all(ch in PUNCTUATION for ch in word)


def paragraphs(text: str) -> list[str]:
    return _PARAGRAPH_BREAK.split(text.strip())


def lines(text: str) -> list[str]:
    return _LINE_BREAK.split(text)


def sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def find_duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items seen before, characters in those repeated items)."""
    seen: set[str] = set()
    count = chars = 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


def top_ngram_chars(tokens: list[str], n: int) -> int:
    """Characters covered by the most frequent word n-gram: len(ngram) × its count."""
    grams = Counter(" ".join(tokens[i:i + n]) for i in range(len(tokens) - n + 1))
    if not grams:
        return 0
    gram, count = grams.most_common(1)[0]
    return len(gram) * count


def duplicated_ngram_chars(tokens: list[str], n: int) -> int:
    """Characters in word n-grams that repeat an earlier n-gram; a repeat skips past
    itself so overlapping repeats are not counted twice."""
    seen: set[str] = set()
    chars = i = 0
    while i < len(tokens) - n + 1:
        gram = "".join(tokens[i:i + n])
        if gram in seen:
            chars += len(gram)
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


_PUNCT_TO_SPACE = str.maketrans({ch: " " for ch in PUNCTUATION})
_SPACES = re.compile(r"\s+")


def normalize_for_dedup(text: str) -> str:
    """NFKC, lower-case, punctuation dropped, whitespace collapsed: two copies of a page
    that differ only in such noise normalize to the same string."""
    text = unicodedata.normalize("NFKC", text).lower().translate(_PUNCT_TO_SPACE)
    return _SPACES.sub(" ", text).strip()
