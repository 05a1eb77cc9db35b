"""Per-stage statistics: documents in, kept, dropped by reason, edits by kind, characters
before and after, and seconds. Workers fill one `StageStats` per stage per shard; the
runner merges them, writes `stats.json` and prints the table."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

MAX_FAILURES = 50  # unreadable files kept by name in stats.json (all are counted)


@dataclass
class StageStats:
    docs_in: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    edits: Counter = field(default_factory=Counter)
    chars_in: int = 0
    chars_out: int = 0
    seconds: float = 0.0
    # files that could not be read to their end: {where, reason, detail}, the first few
    failures: list[dict] = field(default_factory=list)

    @property
    def docs_dropped(self) -> int:
        return sum(self.dropped.values())

    def merge(self, other: StageStats) -> None:
        self.docs_in += other.docs_in
        self.kept += other.kept
        self.dropped.update(other.dropped)
        self.edits.update(other.edits)
        self.chars_in += other.chars_in
        self.chars_out += other.chars_out
        self.seconds += other.seconds
        self.failures = (self.failures + other.failures)[:MAX_FAILURES]

    def to_dict(self) -> dict[str, Any]:
        return {"docs_in": self.docs_in, "kept": self.kept,
                "dropped": dict(sorted(self.dropped.items())),
                "edits": dict(sorted(self.edits.items())),
                "chars_in": self.chars_in, "chars_out": self.chars_out,
                "seconds": round(self.seconds, 3), "failures": self.failures}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageStats:
        return cls(data["docs_in"], data["kept"], Counter(data["dropped"]),
                   Counter(data["edits"]), data["chars_in"], data["chars_out"],
                   data["seconds"], data.get("failures", []))


RunStats = dict[str, StageStats]  # stage name -> stats, in pipeline order


def merge_run_stats(runs: list[RunStats]) -> RunStats:
    total: RunStats = {}
    for run in runs:
        for name, stats in run.items():
            total.setdefault(name, StageStats()).merge(stats)
    return total


def docs_out(stats: RunStats) -> int:
    return list(stats.values())[-1].kept if stats else 0


def format_table(stats: RunStats) -> str:
    """A fixed-width table, one row per stage, with every drop reason and the top edits,
    then the files that could not be read to their end."""
    header = (f"{'stage':<18}{'in':>9}{'kept':>9}{'dropped':>9}{'chars in':>13}"
              f"{'chars out':>13}{'docs/s':>9}  reasons / edits")
    rows = [header, "-" * len(header)]
    for name, s in stats.items():
        rate = f"{s.docs_in / s.seconds:,.0f}" if s.seconds > 0 else "-"
        notes = [f"{k}={v}" for k, v in s.dropped.most_common()]
        notes += [f"+{k}={v}" for k, v in s.edits.most_common(3)]
        rows.append(f"{name:<18}{s.docs_in:>9,}{s.kept:>9,}{s.docs_dropped:>9,}"
                    f"{s.chars_in:>13,}{s.chars_out:>13,}{rate:>9}  {', '.join(notes)}")
    first = next(iter(stats.values()), StageStats())
    rows.append(f"documents: {first.docs_in:,} in, {docs_out(stats):,} out, "
                f"{sum(s.docs_dropped for s in stats.values()):,} dropped")
    rows += [f"unreadable: {f['where']} ({f['reason']}: {f['detail']})"
             for s in stats.values() for f in s.failures[:10]]
    return "\n".join(rows)
