"""What every cleaning stage shares: the config field saying which document kinds it
applies to, and the call signature the pipeline uses."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from lathe.data.document import Document, Verdict

AppliesTo = Literal["prose", "code", "all"]


@dataclass
class StageConfig:
    # Prose filters make no sense on source code; code documents get their own stage.
    applies_to: AppliesTo = "prose"


class Stage(ABC):
    name: str

    def __init__(self, config: StageConfig) -> None:
        self.config = config

    def applies(self, doc: Document) -> bool:
        return self.config.applies_to in ("all", doc.kind)

    @abstractmethod
    def __call__(self, doc: Document) -> Verdict:
        """Judge (and possibly edit in place) one document."""
