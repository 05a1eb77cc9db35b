"""Exact and near-duplicate removal across the whole corpus.

Exact: a 64-bit hash of the normalized text; the first copy is kept.
Near: MinHash over word 5-gram shingles of the normalized text, banded for LSH (14 bands
× 8 rows by default: pairs at Jaccard 0.8 collide in some band with probability 0.92,
pairs at 0.5 with 0.05). Documents sharing a band are joined into clusters (union-find)
and the first document of each cluster is kept.

Signatures are computed in NumPy for a batch of documents at once (one multiply-shift
hash per permutation over all shingles, then a segmented minimum), and only the band
keys — 8 bytes per band per document — are kept, so a million documents need ~112 MB.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from lathe.core.errors import ConfigError
from lathe.data.text import normalize_for_dedup


@dataclass
class DedupConfig:
    exact: bool = True
    near: bool = True
    ngram: int = 5
    bands: int = 14
    rows: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("ngram", "bands", "rows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"dedup.{name} must be >= 1, got {getattr(self, name)}")


def exact_key(text: str) -> int:
    digest = hashlib.blake2b(normalize_for_dedup(text).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: spreads bits so sums of word hashes behave as random keys."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class MinHasher:
    def __init__(self, config: DedupConfig) -> None:
        self.config = config
        num_perm = config.bands * config.rows
        rng = np.random.default_rng(config.seed)
        # multiply-shift hashing: h(x) = (a·x + b) >> 32 with odd a (Dietzfelbinger et al.)
        self.a = rng.integers(1, 2**63, num_perm, dtype=np.uint64) | np.uint64(1)
        self.b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
        self.position = _mix(np.arange(1, config.ngram + 1, dtype=np.uint64))
        self.row_weight = _mix(np.arange(101, 101 + config.rows, dtype=np.uint64)) | np.uint64(1)

    def shingles(self, text: str) -> np.ndarray:
        """64-bit hashes of the word n-grams of the normalized text (one n-gram for short texts)."""
        words = normalize_for_dedup(text).split() or [""]
        h = np.fromiter((zlib.crc32(w.encode()) for w in words), np.uint64, len(words))
        n = min(self.config.ngram, len(words))
        grams = np.zeros(len(words) - n + 1, np.uint64)
        with np.errstate(over="ignore"):
            for k in range(n):
                grams += h[k:len(words) - n + 1 + k] * self.position[k]
            return _mix(grams)

    def band_keys(self, texts: Iterable[str], batch_shingles: int = 1 << 13) -> np.ndarray:
        """(len(texts), bands) uint64 keys; equal keys in a band mark candidate pairs."""
        bands, rows = self.config.bands, self.config.rows
        out: list[np.ndarray] = []
        pending: list[np.ndarray] = []
        size = 0
        for text in texts:
            pending.append(self.shingles(text))
            size += len(pending[-1])
            if size >= batch_shingles:
                out.append(self._band_keys(pending, bands, rows))
                pending, size = [], 0
        if pending:
            out.append(self._band_keys(pending, bands, rows))
        return np.concatenate(out) if out else np.zeros((0, bands), np.uint64)

    def _band_keys(self, shingles: list[np.ndarray], bands: int, rows: int) -> np.ndarray:
        flat = np.concatenate(shingles)
        starts = np.cumsum([0] + [len(s) for s in shingles[:-1]])
        with np.errstate(over="ignore"):
            # batches are kept small (~8k shingles × 112 permutations) so this stays in cache
            hashed = np.multiply(flat[:, None], self.a[None, :])
            hashed += self.b
            hashed >>= np.uint64(32)
            signature = np.minimum.reduceat(hashed, starts, axis=0)  # (docs, bands*rows)
            per_row = signature.reshape(len(shingles), bands, rows) * self.row_weight
            return _mix(per_row.sum(axis=2, dtype=np.uint64))


def first_occurrences(keys: np.ndarray, index: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask: True where a key appears for the first time (documents numbered by
    `index`, ascending; by default 0..n-1)."""
    index = np.arange(len(keys)) if index is None else index
    return np.isin(index, first_indices(keys, index))


def first_indices(keys: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The lowest `index` (ascending) of each distinct key; a bucket of a distributed run
    sees only some keys, with their documents' global indices."""
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    return index[order][np.r_[True, keys[1:] != keys[:-1]]] if len(keys) else index[:0]


def lsh_edges(band_keys: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Edges (doc, lowest doc of its group), shape (E, 2), joining the documents (global
    `index`, ascending) that share a key in some band: together they span every LSH
    cluster."""
    edges = []
    for band in range(band_keys.shape[1]):
        order = np.argsort(band_keys[:, band], kind="stable")
        keys = band_keys[order, band]
        starts = np.r_[True, keys[1:] != keys[:-1]]
        if starts.all():
            continue
        group_first = np.maximum.accumulate(np.where(starts, np.arange(len(keys)), 0))
        same = ~starts
        edges.append(np.stack([index[order][same], index[order][group_first[same]]], axis=1))
    return np.concatenate(edges) if edges else np.zeros((0, 2), np.int64)


def cluster_roots(index: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Boolean mask over `index` (ascending): True for the lowest index of each connected
    component of `edges`."""
    parent = list(range(len(index)))  # a list: scalar access is the hot loop
    links = np.searchsorted(index, edges)  # global indices -> positions in `index`
    if len(links):  # a pair of near copies shares keys in many bands: union it once
        links = np.unique(links[:, 0] * len(index) + links[:, 1])
        links = np.stack([links // len(index), links % len(index)], axis=1)

    def find(i: int) -> int:
        root = i
        while parent[root] != root:
            root = parent[root]
        while parent[i] != root:
            parent[i], i = root, parent[i]
        return root

    for i, j in links.tolist():
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    return np.array([find(i) == i for i in range(len(index))], bool)


def near_duplicate_mask(band_keys: np.ndarray, index: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask: True for the first (lowest-index) document of each LSH cluster
    (documents numbered by `index`, ascending; by default 0..n-1)."""
    index = np.arange(len(band_keys)) if index is None else index
    return cluster_roots(index, lsh_edges(band_keys, index))
