"""Unicode clean-up: mojibake repair with ftfy, then one normalization form (NFC)."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Literal

import ftfy

from lathe.data.document import Document, Verdict, keep
from lathe.data.stages.base import AppliesTo, Stage, StageConfig


@dataclass
class NormalizeConfig(StageConfig):
    applies_to: AppliesTo = "all"
    form: Literal["NFC", "NFKC"] = "NFC"
    fix_mojibake: bool = True


class Normalize(Stage):
    name = "normalize"
    config: NormalizeConfig

    def __call__(self, doc: Document) -> Verdict:
        text = doc.text
        if text.isascii():  # nothing to repair or normalize; ftfy is the slowest stage
            return keep()
        fixed = ftfy.fix_text(text, normalization=None) if self.config.fix_mojibake else text
        normalized = unicodedata.normalize(self.config.form, fixed)
        doc.text = normalized
        return keep(mojibake_fixed=int(fixed != text),
                    unicode_normalized=int(normalized != fixed))
