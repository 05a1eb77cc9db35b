"""Paged-KV bookkeeping: allocation, growth, reference counts, prefix caching, eviction."""

from __future__ import annotations

import random

import pytest

from lathe.serve.block_manager import BlockManager, OutOfBlocks


def test_prompt_takes_ceil_blocks_and_grows_one_block_per_block_size():
    manager = BlockManager(num_blocks=8, block_size=4)
    table = manager.allocate(list(range(10)))
    assert len(table.blocks) == 3 and len(set(table.blocks)) == 3
    assert manager.num_free == 5 and table.num_cached_tokens == 0
    manager.grow(table, 12)
    assert len(table.blocks) == 3
    manager.grow(table, 13)
    assert len(table.blocks) == 4 and manager.num_free == 4
    manager.free_table(table)
    assert manager.num_free == 8 and manager.usage == 0


def test_shared_prefix_hits_only_after_commit_and_only_full_blocks():
    manager = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 110))  # two full blocks + 2 tokens
    first = manager.allocate(prompt)
    second = manager.allocate(prompt)
    assert second.num_cached_tokens == 0  # nothing computed yet: no hit
    manager.commit(first, prompt, num_computed=len(prompt))
    third = manager.allocate(prompt + [7, 7])
    assert third.num_cached_tokens == 8
    assert third.blocks[:2] == first.blocks[:2] and third.blocks[2] != first.blocks[2]
    assert manager.blocks[first.blocks[0]].ref_count == 2
    # the block holding a prompt's last token is never looked up (that token is recomputed)
    assert (manager.prefix_queries, manager.prefix_hits) == (8 + 8 + 8, 8)
    other = manager.allocate([1, 2, 3, 4] + prompt[4:8])  # same second block, other first
    assert other.num_cached_tokens == 0  # the chain differs from the first block on


def test_freed_cached_blocks_are_revived_then_evicted_least_recently_freed_first():
    manager = BlockManager(num_blocks=5, block_size=2)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    table_a = manager.allocate(a)
    manager.commit(table_a, a, 4)
    manager.free_table(table_a)
    table_b = manager.allocate(b)
    manager.commit(table_b, b, 4)
    manager.free_table(table_b)
    assert manager.num_free == 5
    revived = manager.allocate(a + [0])
    assert revived.num_cached_tokens == 4 and manager.num_free == 2
    manager.free_table(revived)
    # a was freed last, so b's blocks are the least recently freed and go first
    manager.allocate([9, 10, 11, 12])
    assert manager.allocate(b + [0]).num_cached_tokens == 0
    assert manager.num_free == 0


def test_out_of_blocks_is_reported_before_anything_changes():
    manager = BlockManager(num_blocks=3, block_size=4)
    table = manager.allocate(list(range(8)))
    assert not manager.can_allocate(list(range(20, 28)))
    with pytest.raises(OutOfBlocks, match="2 blocks needed, 1 free"):
        manager.allocate(list(range(20, 28)))
    assert manager.num_free == 1
    manager.grow(table, 12)
    with pytest.raises(OutOfBlocks):
        manager.grow(table, 13)
    assert not manager.can_append(table, 13)


def test_random_workload_keeps_reference_counts_consistent():
    rng = random.Random(0)
    manager = BlockManager(num_blocks=64, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    live = []
    for _ in range(500):
        if live and (rng.random() < 0.4 or manager.num_free < 8):
            table, tokens = live.pop(rng.randrange(len(live)))
            manager.free_table(table)
            continue
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(9))]
        if not manager.can_allocate(tokens):
            continue
        table = manager.allocate(tokens)
        manager.commit(table, tokens, len(tokens))
        if manager.can_append(table, len(tokens) + 5):
            manager.grow(table, len(tokens) + 5)
        live.append((table, tokens))
        refs = [0] * 64
        for t, _ in live:
            for block_id in t.blocks:
                refs[block_id] += 1
        assert refs == [b.ref_count for b in manager.blocks]
        assert {i for i, r in enumerate(refs) if r == 0} == set(manager.free)
    for table, _ in live:
        manager.free_table(table)
    assert manager.num_free == 64 and manager.prefix_hits > 0


def test_a_cached_prefix_ends_at_the_last_block_keep_allows():
    """A model with linear-attention layers resumes only where their states were kept:
    the cached blocks past the last one `keep` allows are fresh (and counted as such by
    can_allocate), the chain before it shared."""
    manager = BlockManager(num_blocks=12, block_size=4)
    prompt = list(range(20, 34))  # three full blocks and 2 tokens
    first = manager.allocate(prompt)
    manager.commit(first, prompt, len(prompt))
    kept = {manager.hash_of(first.blocks[0])}
    free = manager.num_free
    assert manager.can_allocate(prompt, keep=kept.__contains__)
    table = manager.allocate(prompt, keep=kept.__contains__)
    assert table.num_cached_tokens == 4 and table.num_committed == 1
    assert table.blocks[0] == first.blocks[0] and table.blocks[1] != first.blocks[1]
    assert manager.num_free == free - 3
    assert manager.allocate(prompt, keep=lambda h: False).num_cached_tokens == 0
    assert manager.allocate(prompt).num_cached_tokens == 12  # without keep, every full block
    assert not manager.can_allocate(list(range(100, 120)), keep=kept.__contains__)
