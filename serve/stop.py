"""Stop strings matched on decoded text as it streams, across token boundaries.

Text is released only once it can no longer be the start of a stop string: the longest
tail of the pending text that is a prefix of some stop string is held back. When a stop
string appears, the text before it is released and the stop string itself never is
(OpenAI semantics) — unless `include_stop_str_in_output` (vLLM's) keeps it. Text fed while
not `armed` (before a request's `min_tokens`) is released without looking for stops.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.pending = ""
        self.stopped = False

    def feed(self, text: str, armed: bool = True) -> str:
        """Add newly decoded text; return what may be emitted now."""
        if self.stopped:
            return ""
        self.pending += text
        if not armed:
            out, self.pending = self.pending, ""
            return out
        hits = [(i, s) for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            index, hit = min(hits)
            self.stopped = True
            end = index + len(hit) if self.include_stop else index
            out, self.pending = self.pending[:end], ""
            return out
        hold = self._held_tail()
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        """The held-back text, when generation ends for another reason (EOS, length)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _held_tail(self) -> int:
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest
