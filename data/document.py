"""What flows through the cleaning pipeline: documents, rejected records, and verdicts.

A source yields `Document`s (text, or raw HTML still to be extracted) and `Rejected`
records for input it could not read (invalid JSON, invalid UTF-8, ...). Each stage
looks at one document and returns a `Verdict`: keep it (possibly after editing its
text, with edits counted by kind) or drop it with a named reason, as datatrove's
filters do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["prose", "code"]


@dataclass
class Document:
    id: str
    text: str = ""
    html: str | None = None  # raw HTML not yet extracted; `text` is filled by extraction
    kind: Kind = "prose"
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def chars(self) -> int:
        """Characters of the content a stage sees: raw HTML until extracted, then text."""
        return len(self.html if self.html is not None else self.text)


@dataclass(frozen=True)
class Rejected:
    """An input record that never became a document, and why. A file that could not be
    read to its end is one `Rejected` too, with `where` naming the file and offset and
    `detail` the error."""

    where: str
    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Verdict:
    drop_reason: str | None = None
    edits: dict[str, int] = field(default_factory=dict)

    @property
    def kept(self) -> bool:
        return self.drop_reason is None


KEEP = Verdict()


def drop(reason: str) -> Verdict:
    return Verdict(drop_reason=reason)


def keep(**edits: int) -> Verdict:
    """Keep the document; `edits` counts what the stage changed, by kind (zeros omitted)."""
    return Verdict(edits={kind: n for kind, n in edits.items() if n})
