"""Packing chat examples into rows of `max_len` tokens (`data.packing: true`), and the
packed micro-batch: one row holds several examples end to end, each its own document —
positions restart and attention stays inside it (`Transformer.forward(documents=)`) — so
a packed batch computes the same loss and gradients as its examples padded one by one,
without the padding.

Examples are placed by best-fit decreasing (longest first, each into the row with the
least room that still holds it; the strategy TRL's `packing_strategy="bfd"` takes): it
keeps every example whole — an example split across rows would lose its prompt — and
fills rows to within a few tokens of `max_len` when examples are short against it. The
packing is computed once, from lengths alone, so it is deterministic; the rows are then
shuffled per epoch like examples are.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.common import pad


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total length ≤ `capacity` (each bin in
    placement order), longest first, each into the fullest bin it fits."""
    too_long = [n for n in lengths if n > capacity]
    if too_long:
        raise ValueError(f"an example of {too_long[0]} tokens cannot be packed into rows of "
                         f"{capacity}; fit examples to max_len first")
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, bin), sorted: best fit by bisection
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at == len(room):
            bins.append([i])
            left, b = capacity - lengths[i], len(bins) - 1
        else:
            left, b = room.pop(at)
            bins[b].append(i)
            left -= lengths[i]
        if left > 0:
            bisect.insort(room, (left, b))
    return bins


def collate_packed(rows: list[list[Any]], pad_token: int,
                   device: torch.device) -> dict[str, Any]:
    """Packed rows of (ids, labels, ...) examples -> the model's batch: `ids`, `labels`
    (each example's first label ignored: nothing before it in the row may predict it),
    `documents` (per token, its example's index in the row; padding is one more document),
    `lengths` (every example's, for the work a step does) and `row_lengths` (each row's
    tokens before its padding)."""
    ids, labels, documents, lengths = [], [], [], []
    for row in rows:
        row_ids, row_labels, row_documents = [], [], []
        for index, example in enumerate(row):
            row_ids += example[0]
            row_labels += [IGNORE_INDEX, *example[1][1:]]
            row_documents += [index] * len(example[0])
            lengths.append(len(example[0]))
        ids.append(row_ids)
        labels.append(row_labels)
        documents.append(row_documents)
    padding_document = max(len(row) for row in rows)
    return {"ids": pad(ids, pad_token).to(device), "labels": pad(labels, IGNORE_INDEX).to(device),
            "documents": pad(documents, padding_document).to(device), "lengths": lengths,
            "row_lengths": [len(row_ids) for row_ids in ids]}

