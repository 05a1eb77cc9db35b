"""Gopher's repetition and quality filters (Rae et al. 2021, appendix A), with the
published thresholds as defaults and datatrove's reason names."""

from __future__ import annotations

from dataclasses import dataclass, field

from lathe.data import text as T
from lathe.data.document import Document, Verdict, drop, keep
from lathe.data.stages.base import Stage, StageConfig


@dataclass
class GopherRepetitionConfig(StageConfig):
    dup_line_frac: float = 0.30
    dup_para_frac: float = 0.30
    dup_line_char_frac: float = 0.20
    dup_para_char_frac: float = 0.20
    # [n, max fraction of characters in the most frequent n-gram]
    top_ngram_char_frac: list[list[float]] = field(
        default_factory=lambda: [[2, 0.20], [3, 0.18], [4, 0.16]])
    # [n, max fraction of characters in n-grams repeating an earlier one]
    dup_ngram_char_frac: list[list[float]] = field(
        default_factory=lambda: [[5, 0.15], [6, 0.14], [7, 0.13], [8, 0.12], [9, 0.11],
                                 [10, 0.10]])


class GopherRepetition(Stage):
    name = "gopher_repetition"
    config: GopherRepetitionConfig

    def __call__(self, doc: Document) -> Verdict:
        c, text = self.config, doc.text
        if not text:
            return drop("empty")
        for unit, parts, frac, char_frac in [
                ("para", T.paragraphs(text), c.dup_para_frac, c.dup_para_char_frac),
                ("line", T.lines(text), c.dup_line_frac, c.dup_line_char_frac)]:
            n_dup, dup_chars = T.find_duplicates(parts)
            if n_dup / len(parts) > frac:
                return drop(f"dup_{unit}_frac")
            if dup_chars / len(text) > char_frac:
                return drop(f"dup_{unit}_char_frac")
        words = T.words(text)
        for n, limit in c.top_ngram_char_frac:
            if T.top_ngram_chars(words, int(n)) / len(text) > limit:
                return drop(f"top_{int(n)}_gram")
        for n, limit in c.dup_ngram_char_frac:
            if T.duplicated_ngram_chars(words, int(n)) / len(text) > limit:
                return drop(f"duplicated_{int(n)}_n_grams")
        return keep()


STOP_WORDS = ["the", "be", "to", "of", "and", "that", "have", "with"]


@dataclass
class GopherQualityConfig(StageConfig):
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    min_alpha_words_ratio: float = 0.8
    min_stop_words: int = 2
    stop_words: list[str] = field(default_factory=lambda: list(STOP_WORDS))


class GopherQuality(Stage):
    name = "gopher_quality"
    config: GopherQualityConfig

    def __call__(self, doc: Document) -> Verdict:
        c, text = self.config, doc.text
        words = T.words(text)
        real_words = [w for w in words if not T.is_symbol(w)]
        if len(real_words) < c.min_words:
            return drop("gopher_short_doc")
        if len(real_words) > c.max_words:
            return drop("gopher_long_doc")
        mean_length = sum(map(len, real_words)) / len(real_words)
        if mean_length < c.min_mean_word_length:
            return drop("gopher_below_avg_threshold")
        if mean_length > c.max_mean_word_length:
            return drop("gopher_above_avg_threshold")
        if text.count("#") / len(words) > c.max_symbol_word_ratio:
            return drop("gopher_too_many_hashes")
        if (text.count("...") + text.count("…")) / len(words) > c.max_symbol_word_ratio:
            return drop("gopher_too_many_ellipsis")
        lines = text.splitlines()
        bullets = sum(line.lstrip().startswith(("•", "-")) for line in lines)
        if bullets / len(lines) > c.max_bullet_lines_ratio:
            return drop("gopher_too_many_bullets")
        ellipsis = sum(line.rstrip().endswith(("...", "…")) for line in lines)
        if ellipsis / len(lines) > c.max_ellipsis_lines_ratio:
            return drop("gopher_too_many_end_ellipsis")
        alpha = sum(any(ch.isalpha() for ch in w) for w in words)
        if alpha / len(words) < c.min_alpha_words_ratio:
            return drop("gopher_below_alpha_threshold")
        lowered = {w.lower() for w in words}
        if len(lowered.intersection(c.stop_words)) < c.min_stop_words:
            return drop("gopher_enough_stop_words")
        return keep()
