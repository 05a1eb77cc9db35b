"""The cleaning recipe and the per-document pipeline. `CleanConfig` has one optional
field per stage, in the fixed order they run; a recipe in `recipes/data/` sets a stage
to `null` to leave it out. `Pipeline` runs the per-document stages over a shard's
records and counts everything in `RunStats`; dedup runs after, across shards."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from lathe.core.errors import ConfigError
from lathe.data.dedup import DedupConfig
from lathe.data.document import Document, Rejected
from lathe.data.sources import SourceConfig
from lathe.data.stages.base import Stage
from lathe.data.stages.c4 import C4, C4Config
from lathe.data.stages.code import Code, CodeConfig
from lathe.data.stages.extract import Extract, ExtractConfig
from lathe.data.stages.fineweb import FineWeb, FineWebConfig
from lathe.data.stages.gopher import (
    GopherQuality,
    GopherQualityConfig,
    GopherRepetition,
    GopherRepetitionConfig,
)
from lathe.data.stages.language import Language, LanguageConfig
from lathe.data.stages.normalize import Normalize, NormalizeConfig
from lathe.data.stages.pii import PII, PIIConfig
from lathe.data.stats import MAX_FAILURES, RunStats, StageStats

READ = "read"  # the pseudo-stage counting input records and the bad ones among them


@dataclass
class CleanConfig:
    output_format: Literal["parquet", "jsonl"] = "parquet"
    num_proc: int = 2
    source: SourceConfig = field(default_factory=SourceConfig)
    extract: ExtractConfig | None = field(default_factory=ExtractConfig)
    normalize: NormalizeConfig | None = field(default_factory=NormalizeConfig)
    language: LanguageConfig | None = field(default_factory=LanguageConfig)
    gopher_repetition: GopherRepetitionConfig | None = field(
        default_factory=GopherRepetitionConfig)
    gopher_quality: GopherQualityConfig | None = field(default_factory=GopherQualityConfig)
    c4: C4Config | None = field(default_factory=C4Config)
    fineweb: FineWebConfig | None = field(default_factory=FineWebConfig)
    code: CodeConfig | None = field(default_factory=CodeConfig)
    pii: PIIConfig | None = field(default_factory=PIIConfig)
    dedup: DedupConfig | None = field(default_factory=DedupConfig)

    def __post_init__(self) -> None:
        if self.num_proc < 1:
            raise ConfigError(f"num_proc={self.num_proc} must be at least 1")


STAGES: list[tuple[str, type[Stage]]] = [
    ("extract", Extract), ("normalize", Normalize), ("language", Language),
    ("gopher_repetition", GopherRepetition), ("gopher_quality", GopherQuality),
    ("c4", C4), ("fineweb", FineWeb), ("code", Code), ("pii", PII),
]


class Pipeline:
    def __init__(self, config: CleanConfig) -> None:
        self.stages = [cls(getattr(config, name)) for name, cls in STAGES
                       if getattr(config, name) is not None]

    def new_stats(self) -> RunStats:
        return {name: StageStats() for name in [READ] + [s.name for s in self.stages]}

    def run(self, records: Iterable[Document | Rejected], stats: RunStats) -> Iterator[Document]:
        """Yield the documents that survive every stage, counting into `stats`."""
        read = stats[READ]
        records = iter(records)
        while True:
            start = time.perf_counter()
            record = next(records, None)
            read.seconds += time.perf_counter() - start
            if record is None:
                return
            read.docs_in += 1
            if isinstance(record, Rejected):
                read.dropped[record.reason] += 1
                if record.detail and len(read.failures) < MAX_FAILURES:
                    read.failures.append({"where": record.where, "reason": record.reason,
                                          "detail": record.detail})
                continue
            read.kept += 1
            read.chars_in += record.chars
            read.chars_out += record.chars
            if self.process(record, stats):
                yield record

    def process(self, doc: Document, stats: RunStats) -> bool:
        for stage in self.stages:
            s = stats[stage.name]
            start = time.perf_counter()
            s.docs_in += 1
            s.chars_in += doc.chars
            verdict = stage(doc) if stage.applies(doc) else None
            s.seconds += time.perf_counter() - start
            if verdict is not None and not verdict.kept:
                s.dropped[verdict.drop_reason] += 1
                return False
            s.kept += 1
            s.chars_out += doc.chars
            if verdict is not None:
                s.edits.update(verdict.edits)
        return True
