"""Which sequences run in the next engine step, and how many of their tokens.

Each step first serves every running sequence that is decoding (one token each), then
spends the remaining token budget on prefills: running sequences with prompt left to
compute (chunked prefill), then new ones from the waiting queue in arrival order. When
a decode cannot get a block, the most recently admitted running sequence is preempted
by recompute — its blocks are freed and it goes back to the head of the waiting queue,
keeping the tokens it generated — so the oldest requests always make progress.

With decodes running, a step may also hold its prefills to `prefill_cap` tokens (Sarathi-Serve's
stall-free batching): `StepCost` estimates from the steps the engine times how many prefill
tokens keep a step within a multiple of a decode-only step, so that a burst of new prompts
stretches the running streams' next token by that much at most, not by a whole token budget
of prefill.

With speculative decoding a decode may also get lookahead slots — blocks and token budget
for up to `num_lookahead_slots` draft tokens — when they are free; lookahead never
preempts anyone, so a full cache only makes speculation shorter. Multi-step decoding
reserves its later steps' slots the same way (`reserve`), after the step is scheduled.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lathe.serve.block_manager import BlockManager
from lathe.serve.sequence import Sequence, Status

if TYPE_CHECKING:
    from lathe.serve.outputs import Pick


@dataclass
class ScheduledBatch:
    """(sequence, number of its tokens to compute this step), decodes first."""

    items: list[tuple[Sequence, int]]
    lookahead: dict[Sequence, int] = field(default_factory=dict)  # draft tokens room, per decode
    decodes: int = 0  # how many of the items are decodes (the first ones)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.items[self.decodes:])


class StepCost:
    """Running estimates of what an engine step costs on this model and machine — a
    decode-only step's seconds, and the seconds each prefill token adds — and from them the
    prefill tokens a step that carries decodes may take so that it lasts at most
    `max_stall` decode-only steps (at least `min_tokens`; None until both are known or with
    `max_stall` 0)."""

    SMOOTHING = 0.2  # weight of the newest step in the running averages
    MIN_SAMPLE = 16  # prefill tokens a step needs to measure a token's cost

    def __init__(self, max_stall: float, min_tokens: int) -> None:
        self.max_stall = max_stall
        self.min_tokens = min_tokens
        self.decode_seconds: float | None = None
        self.token_seconds: float | None = None

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTHING * (new - old)

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        """Account one timed step (a forward pass's share of a multi-step one); nothing
        when the budget is off."""
        if not self.max_stall:
            return
        prefill = batch.prefill_tokens
        if prefill == 0:
            self.decode_seconds = self._average(self.decode_seconds, seconds)
        elif self.decode_seconds is not None and prefill >= self.MIN_SAMPLE \
                and seconds > self.decode_seconds:
            # what the step took beyond a decode-only step is its prefill's (one without
            # decodes pays the weights' pass all the same); a step no longer than a decode
            # was timed across a stall of the machine, not measured: averaged in as zero it
            # turned the budget off (CI saw it under load)
            self.token_seconds = self._average(
                self.token_seconds, (seconds - self.decode_seconds) / prefill)

    def prefill_cap(self) -> int | None:
        if not self.max_stall or self.decode_seconds is None or not self.token_seconds:
            return None
        room = (self.max_stall - 1) * self.decode_seconds / self.token_seconds
        return max(self.min_tokens, int(room))


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, num_lookahead_slots: int = 0,
                 admit: Callable[[Sequence], bool] | None = None,
                 prefix_caching: bool = True,
                 prefix_ends: Callable[[int], bool] | None = None) -> None:
        """`admit(seq)`: whether a waiting sequence may start now beyond its blocks (its
        LoRA adapter got a slot); one that may not is passed over, not waited for.
        `prefix_caching`: whether a sequence may start from cached blocks of its prompt;
        `prefix_ends(hash)`: whether a cached prefix may end with that block (`BlockManager.
        allocate`'s `keep`: a model with linear-attention layers, where their states were
        kept)."""
        self.block_manager = block_manager
        self.prefix_caching = prefix_caching
        self.prefix_ends = prefix_ends
        self.admit = admit or (lambda seq: True)
        self.num_lookahead_slots = num_lookahead_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_cap: int | None = None) -> ScheduledBatch:
        """The next step: every decode, then prefills within the token budget — and within
        `prefill_cap` tokens when the step has decodes."""
        items: list[tuple[Sequence, int]] = []
        lookahead: dict[Sequence, int] = {}
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.num_uncomputed != 1 or budget == 0:
                continue
            if self._make_room(seq):
                items.append((seq, 1))
                budget -= 1
                if self.num_lookahead_slots and budget:
                    lookahead[seq] = self.reserve(seq, min(self.num_lookahead_slots, budget))
                    budget -= lookahead[seq]
        decodes = len(items)
        if decodes and prefill_cap is not None:
            budget = min(budget, prefill_cap)
        for seq in self.running:
            if seq.num_uncomputed > 1 and budget > 0:
                count = min(seq.num_uncomputed, budget)
                items.append((seq, count))
                budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = next((s for s in self.waiting if s.ready and self.admit(s)), None)
            if seq is None or not self.block_manager.can_allocate(
                    seq.token_ids, cached := seq.reads_prefix_cache and self.prefix_caching,
                    seq.cache_root, self.prefix_ends):
                break
            self.waiting.remove(seq)
            seq.table = self.block_manager.allocate(seq.token_ids, cached, seq.cache_root,
                                                    self.prefix_ends)
            seq.num_computed = seq.table.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            count = min(seq.num_uncomputed, budget)
            items.append((seq, count))
            budget -= count
        return ScheduledBatch(items, lookahead, decodes)

    def update_from_output(self, batch: ScheduledBatch, picks: Mapping[Sequence, list[Pick]],
                           cacheable: Callable[[Sequence, int], int] | None = None) -> None:
        """After a step ran `batch`: count the KV of each sequence's accepted drafts and later
        passes as computed (all its new tokens but the last), and offer its newly full blocks
        to the prefix cache — only as far as `cacheable` says (a draft model's KV must cover
        them too)."""
        for seq, _ in batch.items:
            new = [token for token, _ in picks.get(seq, [])]
            seq.num_computed += max(len(new) - 1, 0)
            computed = seq.num_computed if cacheable is None else cacheable(seq, seq.num_computed)
            if self.block_manager.has_uncommitted(seq.table, computed):
                self.block_manager.commit(seq.table, seq.token_ids + new, computed)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (EOS, stop, length or abort) and release its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.block_manager.free_table(seq.table)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _make_room(self, seq: Sequence) -> bool:
        """Grow `seq` by its next token's block, preempting the newest sequences if needed;
        False when `seq` itself had to be preempted."""
        while not self.block_manager.can_append(seq.table, seq.num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.grow(seq.table, seq.num_tokens)
        return True

    def decode_run(self, batch: ScheduledBatch, decode_steps: int) -> int:
        """How many forward passes `batch` runs: up to `decode_steps` when every scheduled
        sequence decodes one token and samples without penalties (which read the tokens
        the run has not handed over yet), no sequence runs past its max_tokens, and free
        blocks hold the later passes' KV; else 1."""
        steps = decode_steps
        if steps == 1 or batch.lookahead or any(
                count != 1 or seq.num_uncomputed != 1 or seq.params.penalized
                for seq, count in batch.items):
            return 1
        for seq, _ in batch.items:
            steps = min(steps, seq.params.max_tokens - len(seq.output_ids))
        for seq, _ in batch.items:
            if steps > 1:
                steps = min(steps, 1 + self.reserve(seq, steps - 1))
        return steps

    def reserve(self, seq: Sequence, wanted: int) -> int:
        """Grow `seq` by up to `wanted` slots past its next token that free blocks allow,
        preempting no one; how many it got."""
        manager = self.block_manager
        room = len(seq.table.blocks) * manager.block_size - seq.num_tokens
        extra = max(0, min(manager.num_free * manager.block_size + room, wanted) - room)
        if extra:
            manager.grow(seq.table, seq.num_tokens + room + extra)
        return min(room + extra, wanted)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_table(seq.table)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
