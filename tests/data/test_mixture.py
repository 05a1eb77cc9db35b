"""Weighted mixtures: exact proportions (and within 1% over any 10k-example prefix), the
same set for the same seed, exact resume of the batches drawn from it, repeats only when
asked for, and clear errors for bad weights and empty sources."""

from __future__ import annotations

from collections import Counter

import pytest

from lathe.core.config import load_config
from lathe.core.errors import ConfigError
from lathe.data.formats import load_chat_dataset
from lathe.data.mixture import WeightedSource, apportion, load_mixture
from lathe.posttrain.common import ShuffledBatches
from lathe.posttrain.config import SFTConfig


def numbered(sizes: dict[str, int]):
    """A loader of `sizes[name]` distinct rows per source."""
    def load(source: str, split: str, limit: int | None) -> list[str]:
        return [f"{source}-{split}-{i}" for i in range(sizes[source])][:limit]
    return load


def test_apportion_is_exact():
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert apportion(10_000, [0.7, 0.2, 0.1]) == [7000, 2000, 1000]
    assert sum(apportion(9_999, [3, 5, 11])) == 9_999


def test_mixture_hits_its_proportions_and_is_seeded():
    sources = [WeightedSource("a", 0.6), WeightedSource("b", 0.3), WeightedSource("c", 0.1)]
    load = numbered({"a": 30_000, "b": 12_000, "c": 2_500})
    mixture = load_mixture(sources, load, "train", None, seed=0)
    # c runs out first: 2,500 rows at 10% bound the set at 25,000 with no repeat
    assert len(mixture.rows) == 25_000 and mixture.drawn == [15_000, 7_500, 2_500]
    assert len(set(mixture.rows)) == 25_000
    prefix = Counter(mixture.source_of[:10_000])
    for index, share in enumerate((0.6, 0.3, 0.1)):
        assert abs(prefix[index] / 10_000 - share) < 0.01
    again = load_mixture(sources, load, "train", None, seed=0)
    assert again.rows == mixture.rows and again.source_of == mixture.source_of
    assert load_mixture(sources, load, "train", None, seed=1).rows != mixture.rows
    assert mixture.report().startswith("mixture: a 60.0% (15,000 of 30,000)")


def test_a_limit_past_a_source_repeats_it_and_says_so():
    mixture = load_mixture([WeightedSource("a", 1), WeightedSource("b", 1)],
                           numbered({"a": 10, "b": 100}), "train", 40, seed=0)
    assert mixture.drawn == [20, 20]
    counts = Counter(row for row, source in zip(mixture.rows, mixture.source_of, strict=True)
                     if source == 0)
    assert set(counts.values()) == {2}  # each of a's 10 rows twice, none thrice
    assert "a 50.0% (20 of 10, each row ×2.00)" in mixture.report()


def test_batches_over_a_mixture_resume_exactly():
    mixture = load_mixture([WeightedSource("a", 2), WeightedSource("b", 1)],
                           numbered({"a": 200, "b": 100}), "train", None, seed=0)
    straight = ShuffledBatches(mixture.rows, 8, seed=3)
    expected = [straight.next() for _ in range(60)]  # past the first epoch
    first = ShuffledBatches(mixture.rows, 8, seed=3)
    got = [first.next() for _ in range(25)]
    resumed = ShuffledBatches(mixture.rows, 8, seed=3)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.next() for _ in range(35)]
    assert got == expected
    taken = resumed.taken()
    assert len(taken) == 60 * 8  # 37 steps of the first epoch (its last 4 rows skipped), 23
    assert Counter(taken) == Counter(row for step in expected for row in step)


@pytest.mark.parametrize("weight", [0, -1.0, float("nan")])
def test_a_weight_that_is_not_positive_is_refused(weight):
    with pytest.raises(ConfigError, match=f"mixture source 'a': weight={weight!r} must be a "
                                          "positive number"):
        WeightedSource("a", weight)


def test_empty_and_repeated_sources_are_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=f"mixture source '{empty}' has no train rows"):
        load_mixture([WeightedSource("task:arithmetic"), WeightedSource(str(empty))],
                     load_chat_dataset, "train", None)
    with pytest.raises(ConfigError, match="lists a source twice"):
        load_mixture([WeightedSource("a"), WeightedSource("a")], numbered({"a": 3}), "train",
                     None)
    with pytest.raises(ConfigError, match="lists no source"):
        load_mixture([], numbered({}), "train", None)


def test_a_recipe_gives_data_train_as_a_weighted_list():
    config = load_config(SFTConfig, None, [
        "--data.train=[{source: 'task:arithmetic', weight: 3}, {source: 'task:arithmetic3'}]"])
    assert config.data.train == [WeightedSource("task:arithmetic", 3.0),
                                 WeightedSource("task:arithmetic3", 1.0)]
    with pytest.raises(ConfigError, match="source .a.: weight=0.0 must be a positive number"):
        load_config(SFTConfig, None, ["--data.train=[{source: a, weight: 0}]"])
