"""Language identification with py3langid, whose model ships inside its wheel (nothing is
downloaded). Keeps documents whose top language is allowed with enough confidence and
records `language` / `language_score` in their metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from lathe.data.document import Document, Verdict, drop, keep
from lathe.data.stages.base import Stage, StageConfig


@dataclass
class LanguageConfig(StageConfig):
    languages: list[str] = field(default_factory=lambda: ["en"])
    min_score: float = 0.65


@cache
def _identifier():
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


class Language(Stage):
    name = "language"
    config: LanguageConfig

    def __call__(self, doc: Document) -> Verdict:
        lang, score = _identifier().classify(doc.text.replace("\n", " "))
        doc.metadata["language"], doc.metadata["language_score"] = lang, round(float(score), 4)
        if lang not in self.config.languages:
            return drop("wrong_language")
        if score < self.config.min_score:
            return drop("low_language_score")
        return keep()
