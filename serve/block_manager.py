"""The paged KV cache's bookkeeping: a fixed pool of blocks, a block table per sequence,
reference counts, and automatic prefix caching.

The KV tensors themselves live elsewhere (one slab per layer, indexed by block id); this
module only decides which block holds which tokens. A *full* block is identified by a
chained hash of (its parent block's hash, its token ids), so two sequences whose prompts
share a prefix share those blocks, whatever their position in the batch. A block whose
reference count drops to zero goes to the back of the free queue but keeps its hash: a
later request with the same prefix revives it, and allocation takes the front of the
queue, so the least recently freed cached block is the one evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

NO_HASH = -1


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """Chained key of a full block: equal only for equal token prefixes (up to hash
    collisions, which `BlockManager` rules out by comparing the stored token ids)."""
    return hash((parent, tuple(token_ids)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: tuple[int, ...] = ()


@dataclass
class BlockTable:
    """The blocks one sequence's tokens occupy, in order, and how many of its leading
    tokens were found in the prefix cache (their KV need not be computed)."""

    blocks: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_committed: int = 0  # leading blocks whose hash chain is settled (`commit`)
    root: int = NO_HASH  # what its first block's hash chains from (a LoRA adapter's own)


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks; the scheduler must wait or preempt."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `num_tokens`."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence."""
        return 1 - len(self.free) / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, token_ids: Sequence[int], use_cache: bool = True,
                     root: int = NO_HASH, keep: Callable[[int], bool] | None = None) -> bool:
        """Whether `allocate(token_ids, use_cache, root, keep)` would succeed now (cached
        blocks in use are free of charge; cached blocks sitting in the free queue still take
        a free slot)."""
        hits = self._cached_prefix(token_ids, use_cache, root, keep)
        needed = self.blocks_needed(len(token_ids)) - len(hits) \
            + sum(block.ref_count == 0 for block in hits)
        return needed <= len(self.free)

    def allocate(self, token_ids: Sequence[int], use_cache: bool = True,
                 root: int = NO_HASH, keep: Callable[[int], bool] | None = None) -> BlockTable:
        """Blocks for a new sequence's prompt, reusing cached full blocks of its prefix
        (unless `use_cache` is False: a prompt being scored computes every position).
        `root` starts the hash chain: sequences with different roots (different LoRA
        adapters) never share a block. `keep(hash)`: whether a cached prefix may end with
        that block (a model with linear-attention layers resumes only where their states
        were kept); the cached blocks past the last it keeps are computed again.

        The cache is consulted until the first miss; the blocks after it are fresh and
        join the cache only once `commit` reports their KV computed. The block holding the
        last token is never taken from the cache: that token is always computed (its
        logits give the next token), and computing it must not write into a shared block.
        """
        if not self.can_allocate(token_ids, use_cache, root, keep):
            raise OutOfBlocks(f"{self.blocks_needed(len(token_ids))} blocks needed, "
                              f"{len(self.free)} free")
        hits = self._cached_prefix(token_ids, use_cache, root, keep)
        table = BlockTable(root=root)
        for block in hits:
            self._share(block)
            table.blocks.append(block.block_id)
        table.num_cached_tokens = len(hits) * self.block_size
        table.num_committed = len(hits)
        if use_cache:
            self.prefix_queries += sum(
                len(token_ids[start:start + self.block_size])
                for start in range(0, len(token_ids), self.block_size)
                if self._lookable(start, len(token_ids)))
            self.prefix_hits += table.num_cached_tokens
        while len(table.blocks) < self.blocks_needed(len(token_ids)):
            table.blocks.append(self._take_fresh().block_id)
        return table

    def _cached_prefix(self, token_ids: Sequence[int], use_cache: bool, root: int,
                       keep: Callable[[int], bool] | None) -> list[Block]:
        """The cached blocks a new sequence's prompt starts with: its full blocks found in
        the cache, up to the first miss, and (with `keep`) up to the last that `keep`s."""
        hits: list[Block] = []
        if not use_cache:
            return hits
        parent = root
        for start in range(0, len(token_ids), self.block_size):
            if not self._lookable(start, len(token_ids)):
                break
            block = self._lookup(parent, token_ids[start:start + self.block_size])
            if block is None:
                break
            hits.append(block)
            parent = block.hash
        if keep is not None:
            while hits and not keep(hits[-1].hash):
                hits.pop()
        return hits

    def can_append(self, table: BlockTable, num_tokens: int) -> bool:
        """Whether the sequence can grow to `num_tokens` tokens with the free blocks left."""
        return self.blocks_needed(num_tokens) - len(table.blocks) <= len(self.free)

    def grow(self, table: BlockTable, num_tokens: int) -> None:
        """Open blocks until the table holds `num_tokens` tokens."""
        if not self.can_append(table, num_tokens):
            raise OutOfBlocks(f"growing to {num_tokens} tokens needs "
                              f"{self.blocks_needed(num_tokens) - len(table.blocks)} blocks, "
                              f"{len(self.free)} free")
        while len(table.blocks) < self.blocks_needed(num_tokens):
            table.blocks.append(self._take_fresh().block_id)

    def hash_of(self, block_id: int) -> int:
        """A block's chained hash (NO_HASH until it is full and committed)."""
        return self.blocks[block_id].hash

    def has_uncommitted(self, table: BlockTable, num_computed: int) -> bool:
        """Whether `num_computed` tokens fill a block `commit` has not seen yet."""
        return num_computed // self.block_size > table.num_committed

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Offer to the prefix cache every full block whose KV is now computed (each block
        once: the table remembers how far its chain is settled)."""
        full = num_computed // self.block_size
        start = table.num_committed
        parent = self.blocks[table.blocks[start - 1]].hash if start else table.root
        for index in range(start, full):
            block = self.blocks[table.blocks[index]]
            if block.hash == NO_HASH:
                first = index * self.block_size
                self._complete(block, parent, tuple(token_ids[first:first + self.block_size]))
            parent = block.hash
        table.num_committed = max(start, full)

    def free_table(self, table: BlockTable) -> None:
        """Release a finished, aborted or preempted sequence's blocks (last first, so that a
        prompt's tail is evicted before its shared head)."""
        for block_id in reversed(table.blocks):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        table.blocks.clear()
        table.num_cached_tokens = table.num_committed = 0
        table.root = NO_HASH

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (after new weights, the stored KV is stale). Only
        valid with no sequence holding blocks."""
        if self.num_free != len(self.blocks):
            raise RuntimeError("reset_prefix_cache needs every block free; finish or abort "
                               "the running sequences first")
        for block in self.blocks:
            block.hash, block.token_ids = NO_HASH, ()
        self.cached.clear()

    def _lookable(self, start: int, num_tokens: int) -> bool:
        """Whether the block starting at token `start` may come from the prefix cache."""
        return start + self.block_size < num_tokens

    def _lookup(self, parent: int, chunk: Sequence[int]) -> Block | None:
        block_id = self.cached.get(block_hash(parent, chunk))
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == tuple(chunk) else None

    def _share(self, block: Block) -> Block:
        """One more reference to a block in use or revived from the free queue."""
        if block.ref_count == 0:
            del self.free[block.block_id]
        block.ref_count += 1
        return block

    def _take_fresh(self) -> Block:
        """The least recently freed block, its cached content (if any) evicted."""
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash, block.token_ids, block.ref_count = NO_HASH, (), 1
        return block

    def _complete(self, block: Block, parent: int, chunk: tuple[int, ...]) -> None:
        """Give a now-full block its chained hash and offer it to the prefix cache, unless
        an identical block is cached already (then this copy stays private, but keeps the
        hash so the blocks after it chain correctly)."""
        block.hash, block.token_ids = block_hash(parent, chunk), chunk
        self.cached.setdefault(block.hash, block.block_id)
