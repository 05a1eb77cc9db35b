"""C4's line and page rules (Raffel et al. 2020, section 2.2, and its reference code):
lines without terminal punctuation, with < 3 words, a > 1000-char word, "javascript" or
cookie/policy boilerplate are removed; pages with "lorem ipsum", a curly bracket or < 5
sentences left are dropped; Wikipedia-style citation markers are deleted."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lathe.data import text as T
from lathe.data.document import Document, Verdict, drop, keep
from lathe.data.stages.base import Stage, StageConfig

CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]", re.IGNORECASE)
TERMINAL_PUNCTUATION = (".", "?", "!", '"', "'")
POLICY_PHRASES = ["terms of use", "privacy policy", "cookie policy", "uses cookies",
                  "use of cookies", "use cookies"]


@dataclass
class C4Config(StageConfig):
    remove_citations: bool = True
    require_terminal_punctuation: bool = True
    min_words_per_line: int = 3
    max_word_length: int = 1000
    drop_javascript_lines: bool = True
    policy_phrases: list[str] = field(default_factory=lambda: list(POLICY_PHRASES))
    drop_lorem_ipsum: bool = True
    drop_curly_bracket: bool = True
    min_sentences: int = 5


class C4(Stage):
    name = "c4"
    config: C4Config

    def __call__(self, doc: Document) -> Verdict:
        c = self.config
        kept: list[str] = []
        removed = citations = n_sentences = 0
        for line in doc.text.splitlines():
            line = line.strip()
            if not line:
                continue
            line_words = line.split()
            if any(len(w) > c.max_word_length for w in line_words):
                removed += 1
                continue
            if c.remove_citations:
                line, n = CITATION.subn("", line)
                citations += n
            if c.require_terminal_punctuation and (
                    not line.endswith(TERMINAL_PUNCTUATION) or line.endswith("...")):
                removed += 1
                continue
            if len(line_words) < c.min_words_per_line:
                removed += 1
                continue
            lowered = line.lower()
            if c.drop_lorem_ipsum and "lorem ipsum" in lowered:
                return drop("lorem_ipsum")
            if c.drop_javascript_lines and "javascript" in lowered:
                removed += 1
                continue
            if c.drop_curly_bracket and "{" in line:
                return drop("curly_bracket")
            if any(p in lowered for p in c.policy_phrases):
                removed += 1
                continue
            n_sentences += len(T.sentences(line))
            kept.append(line)
        if n_sentences < c.min_sentences:
            return drop("too_few_sentences")
        doc.text = "\n".join(kept)
        return keep(lines_removed=removed, citations_removed=citations)
