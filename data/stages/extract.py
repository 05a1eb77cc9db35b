"""HTML → main text with trafilatura, under a per-document time limit: a page that
fails, times out or yields nothing is dropped with that reason, never the run."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import trafilatura

from lathe.data.document import Document, Verdict, drop, keep
from lathe.data.stages.base import AppliesTo, Stage, StageConfig


@dataclass
class ExtractConfig(StageConfig):
    applies_to: AppliesTo = "all"
    timeout_s: float = 10.0
    include_tables: bool = True
    include_comments: bool = False
    favor_precision: bool = False


class ExtractionTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ExtractionTimeout in the main thread after `seconds` (SIGALRM). Off the main
    thread (where signals cannot be delivered) the limit is not enforced."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise ExtractionTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Extract(Stage):
    name = "extract"
    config: ExtractConfig

    def applies(self, doc: Document) -> bool:
        return doc.html is not None and super().applies(doc)

    def __call__(self, doc: Document) -> Verdict:
        try:
            with time_limit(self.config.timeout_s):
                text = trafilatura.extract(
                    doc.html, include_tables=self.config.include_tables,
                    include_comments=self.config.include_comments,
                    favor_precision=self.config.favor_precision)
        except ExtractionTimeout:
            return drop("extraction_timeout")
        except Exception:  # trafilatura/lxml raise many kinds on broken markup
            return drop("extraction_failed")
        if not text or not text.strip():
            return drop("extraction_empty")
        doc.text, doc.html = text, None
        return keep()
