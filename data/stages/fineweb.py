"""FineWeb's own quality rules (Penedo et al. 2024), which catch list-like and
boilerplate pages that Gopher and C4 let through."""

from __future__ import annotations

from dataclasses import dataclass

from lathe.data import text as T
from lathe.data.document import Document, Verdict, drop, keep
from lathe.data.stages.base import Stage, StageConfig


@dataclass
class FineWebConfig(StageConfig):
    min_punctuated_lines_ratio: float = 0.12
    short_line_length: int = 30
    max_short_lines_ratio: float = 0.67
    max_duplicate_line_chars_ratio: float = 0.01
    max_newlines_per_word: float = 0.3


class FineWeb(Stage):
    name = "fineweb"
    config: FineWebConfig

    def __call__(self, doc: Document) -> Verdict:
        c = self.config
        lines = [line for line in doc.text.split("\n") if line.strip()]
        if not lines:
            return drop("empty")
        if sum(line.endswith((".", "!", "?", '"', "'", "…", "。"))
               for line in lines) / len(lines) < c.min_punctuated_lines_ratio:
            return drop("line_punct_ratio")
        if sum(len(line) <= c.short_line_length
               for line in lines) / len(lines) > c.max_short_lines_ratio:
            return drop("short_line_ratio")
        if T.find_duplicates(lines)[1] / max(len(doc.text.replace("\n", "")), 1) > \
                c.max_duplicate_line_chars_ratio:
            return drop("char_dup_ratio")
        if doc.text.count("\n") / max(len(T.words(doc.text)), 1) > c.max_newlines_per_word:
            return drop("list_ratio")
        return keep()
