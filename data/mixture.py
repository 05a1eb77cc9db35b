"""Weighted dataset mixtures: several sources (chat files, `hf:` datasets, embedded tasks)
drawn in stated proportions into one training set.

A mixture is materialized, not sampled on the fly: each source's share of the set is
its weight's share of the total, apportioned by largest remainder so the counts are
exact, and each source gives that many rows in a seeded order. The total is `limit` when
given; otherwise the largest set in which no source repeats a row (the first source to
run out bounds it, as `interleave_datasets(stopping_strategy="first_exhausted")`). A
`limit` that asks a source for more rows than it has cycles through it again in a new
seeded order, and the mixture reports the repeat. The same (sources, weights, limit,
seed) always gives the same rows in the same order, so a run resumed mid-epoch
continues over the same set.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from lathe.core.errors import ConfigError

Row = TypeVar("Row")


@dataclass
class WeightedSource:
    """One source of a mixture and its weight (weights are relative: they need not sum
    to 1)."""

    source: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.weight, (int, float)) or not self.weight > 0 \
                or not math.isfinite(self.weight):
            raise ConfigError(f"mixture source {self.source!r}: weight={self.weight!r} must be "
                              "a positive number; drop the source instead of weighting it 0")


@dataclass
class Mixture(Generic[Row]):
    """The rows drawn, the index of the source each came from, and per source its name,
    share, the rows it has and how many it gave."""

    rows: list[Row]
    source_of: list[int]
    names: list[str]
    shares: list[float]
    available: list[int]
    drawn: list[int]

    def report(self) -> str:
        parts = []
        for name, share, have, took in zip(self.names, self.shares, self.available,
                                           self.drawn, strict=True):
            repeat = f", each row ×{took / have:.2f}" if took > have else ""
            parts.append(f"{name} {share:.1%} ({took:,} of {have:,}{repeat})")
        return "mixture: " + "; ".join(parts)


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in proportion to `weights`, exactly (largest remainder)."""
    scale = total / sum(weights)
    quotas = [w * scale for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[:total - sum(counts)]:
        counts[i] += 1
    return counts


def _draw(rows: Sequence[Row], count: int, rng: random.Random) -> list[Row]:
    """`count` rows in a seeded order, passing through `rows` again when it runs out."""
    drawn: list[Row] = []
    while len(drawn) < count:
        order = list(range(len(rows)))
        rng.shuffle(order)
        drawn.extend(rows[i] for i in order[:count - len(drawn)])
    return drawn


def load_mixture(sources: Sequence[WeightedSource],
                 load: Callable[[str, str, int | None], list[Row]], split: str,
                 limit: int | None, seed: int = 0) -> Mixture[Row]:
    """Draw a mixture of `sources`, each read by `load(source, split, None)`."""
    if not sources:
        raise ConfigError("the mixture lists no source; give data.train a source, or a list "
                          "of {source, weight}")
    names = [s.source for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"the mixture lists a source twice ({names}); give each source once "
                          "with the sum of its weights")
    loaded = [load(s.source, split, None) for s in sources]
    for name, rows in zip(names, loaded, strict=True):
        if not rows:
            raise ConfigError(f"mixture source {name!r} has no {split} rows; fix or drop it")
    weights = [s.weight for s in sources]
    shares = [w / sum(weights) for w in weights]
    if limit is None:
        limit = min(math.floor(len(rows) / share + 1e-9)
                    for rows, share in zip(loaded, shares, strict=True))
    counts = apportion(limit, weights)
    rng = random.Random(seed)
    picked = [_draw(rows, n, rng) for rows, n in zip(loaded, counts, strict=True)]
    # interleaved in a seeded order, so a cut or a prefix of the set keeps the proportions
    order = [i for i, n in enumerate(counts) for _ in range(n)]
    rng.shuffle(order)
    cursors = [0] * len(sources)
    rows, source_of = [], []
    for i in order:
        rows.append(picked[i][cursors[i]])
        source_of.append(i)
        cursors[i] += 1
    return Mixture(rows, source_of, names, shares, [len(r) for r in loaded], counts)


def load_rows(source: str | Sequence[WeightedSource],
              load: Callable[[str, str, int | None], list[Row]], split: str,
              limit: int | None, seed: int = 0) -> tuple[list[Row], Mixture[Row] | None]:
    """The rows of one source (`load(source, split, limit)`), or of a weighted mixture of
    sources, with its draw."""
    if isinstance(source, str):
        return load(source, split, limit), None
    mixture = load_mixture(source, load, split, limit, seed)
    return mixture.rows, mixture
