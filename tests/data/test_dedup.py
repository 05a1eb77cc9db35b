"""Exact and MinHash near-duplicate detection."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lathe.core.errors import ConfigError
from lathe.data.dedup import (
    DedupConfig,
    MinHasher,
    cluster_roots,
    exact_key,
    first_indices,
    first_occurrences,
    lsh_edges,
    near_duplicate_mask,
)
from lathe.data.text import normalize_for_dedup

VOCAB = [f"word{i}" for i in range(3000)]


def shingle_jaccard(a: str, b: str, n: int = 5) -> float:
    def grams(t):
        w = normalize_for_dedup(t).split()
        return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}

    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb)


def test_exact_key_ignores_case_punctuation_and_whitespace():
    assert exact_key("Hello,   World!\n") == exact_key("hello world")
    assert exact_key("hello world") != exact_key("hello there")
    keys = np.array([exact_key(t) for t in ["a b", "A  b.", "c", "a b"]], np.uint64)
    assert first_occurrences(keys).tolist() == [True, False, True, False]


def test_minhash_catches_planted_near_duplicates_and_keeps_distinct_documents():
    rng = random.Random(0)
    originals = [" ".join(rng.choices(VOCAB, k=300)) for _ in range(200)]
    planted, jaccards = [], []
    for text in originals[:60]:
        words = text.split()
        for i in rng.sample(range(len(words)), 3):  # ~3 words changed: Jaccard ~0.85-0.95
            words[i] = rng.choice(VOCAB)
        planted.append(" ".join(words))
        jaccards.append(shingle_jaccard(text, planted[-1]))
    assert min(jaccards) >= 0.8
    keep = near_duplicate_mask(MinHasher(DedupConfig()).band_keys(originals + planted))
    assert keep[:200].all(), "distinct documents were merged"
    assert not keep[200:].any(), "a planted near-duplicate was kept"


def test_minhash_keeps_pairs_far_below_the_threshold():
    rng = random.Random(1)
    a = rng.choices(VOCAB, k=300)
    b = list(a)
    for i in rng.sample(range(300), 90):  # Jaccard ~0.1
        b[i] = rng.choice(VOCAB)
    assert shingle_jaccard(" ".join(a), " ".join(b)) < 0.3
    keep = near_duplicate_mask(MinHasher(DedupConfig()).band_keys([" ".join(a), " ".join(b)]))
    assert keep.tolist() == [True, True]


def test_clusters_are_transitive_and_keep_the_first_member():
    keys = np.array([[1, 10], [2, 10], [2, 20], [3, 30]], np.uint64)  # 0~1 (band 1), 1~2 (band 0)
    assert near_duplicate_mask(keys).tolist() == [True, False, False, True]


def test_band_keys_are_deterministic_and_short_texts_work():
    hasher = MinHasher(DedupConfig(bands=4, rows=2))
    a = hasher.band_keys(["one two", "", "a b c d e f g"])
    b = MinHasher(DedupConfig(bands=4, rows=2)).band_keys(["one two", "", "a b c d e f g"])
    assert a.shape == (3, 4) and (a == b).all()


def test_invalid_config_is_rejected():
    with pytest.raises(ConfigError, match="dedup.bands"):
        DedupConfig(bands=0)


def test_bucketed_resolution_keeps_what_the_whole_array_keeps():
    """The Ray executor resolves dedup per bucket of keys: first indices per key bucket and
    LSH edges per (band, key) bucket, unioned afterwards, must keep the same documents as
    resolving the whole array at once."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, bands = int(rng.integers(1, 80)), int(rng.integers(1, 5))
        band_keys = rng.integers(0, int(rng.integers(2, 30)), (n, bands)).astype(np.uint64)
        index = np.sort(rng.choice(10 * n, n, replace=False))  # global indices of survivors
        edges = []
        for band in range(bands):
            for bucket in range(3):
                rows = np.flatnonzero(band_keys[:, band] % 3 == bucket)
                edges.append(lsh_edges(band_keys[rows, band][:, None], index[rows]))
        assert (cluster_roots(index, np.concatenate(edges)) ==
                near_duplicate_mask(band_keys)).all()
        keys = band_keys[:, 0]
        firsts = np.concatenate([first_indices(keys[keys % 3 == b], index[keys % 3 == b])
                                 for b in range(3)])
        assert (np.isin(index, firsts) == first_occurrences(keys)).all()
