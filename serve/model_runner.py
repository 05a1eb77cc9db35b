"""The engine's hot path: a scheduled batch in, the model's logits out (nano-vllm's
ModelRunner).

Every sequence the engine runs owns a row of one persistent device tensor, its block
table, mirrored on the host so that a row is written only when its sequence's blocks
change (a new block every `block_size` tokens, a reallocation after a preemption). A
decode step's inputs — tokens, positions, slot mapping, block tables, context lengths —
are then a few batched tensor ops over the rows, not per-sequence lists of tensors; a
multi-step run's passes (`prepare_decodes`) get all their inputs in one host-to-device
copy, each pass fed the tokens the last one sampled.
Prefill chunks — and a speculative step's verified drafts, which are a short chunk — gather
their context through the same rows; on CPU a short one instead attends token by token
through them in the native paged kernel, beside the step's decodes. A draft model runs
through the same rows on its own slabs: its KV lives in the target's block ids, so it is
paged, shared and freed with them. A model's linear-attention layers keep each sequence's
state in the row of its block table (`lathe.serve.recurrent_states`); every step carries
where its sequences lie (`StateSpans`) and which snapshot their states for the prefix cache
(prefill chunks and decodes at block boundaries); a preempted sequence's row goes back
(it starts again when readmitted), so the rows never outgrow `max_num_seqs`.
With `compile_decode`, a step of the target whose every token attends through its block
table — decodes, and on CPU those short prefill chunks and drafts — runs through
`lathe.serve.decode_graph` instead: the same rows, a token each, at compiled static shapes
(a 4-token prompt's first step on the README model: 0.38 ms against 1.30 ms eager); with
linear-attention layers, a step of decodes alone does, snapshots taken after it. On CPU the
runner loads lathe's native kernels: paged decode attention that reads the slabs in
place, few-row linears, the greedy pick, and the quantized GEMMs as ops a compiled step
calls without Python; and it has glibc keep freed memory mapped
(`lathe.serve.host_memory`), so that a step's temporaries do not fault their pages in
again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq

import torch
from torch import Tensor

from lathe.kernels.cpu_native import load_cpu_kernels, native_inference, native_kernel
from lathe.kernels.decode_linear import bound_linear
from lathe.model.transformer import Transformer
from lathe.serve.block_manager import NO_HASH
from lathe.serve.decode_graph import DecodeGraphs, Progress, StaticDecodeBatch
from lathe.serve.host_memory import retain_freed_memory
from lathe.serve.paged_cache import KVSlabs, PagedBatch, SequenceSpan
from lathe.serve.quant import is_quantized
from lathe.serve.recurrent_states import RecurrentStates, StateSnapshots, StateSpans
from lathe.serve.sequence import Sequence, Status

log = logging.getLogger("lathe.serve")

# a sequence, the position of its first new token, the new tokens
StepItem = tuple[Sequence, int, list[int]]

# On CPU, with the native paged kernel, a prefill chunk whose context's K and V (a layer's)
# fit in this many bytes attends token by token through its block table, in the same call
# as the step's decodes: each token re-reads its context, which at this size stays in a
# core's L2 cache, and the step makes one kernel call a layer instead of a gather and an
# SDPA call per sequence (the README model, whose 512-token context is 256 KiB: a prefill
# step of 16 prompts of 32-128 tokens in ~23 ms against ~30). Larger contexts would be
# re-read from memory, where SDPA reads them once.
PAGED_PREFILL_BYTES = 256 << 10


def _starts(items: Seq[StepItem]) -> list[int]:
    """Where each item's tokens start in a row of all of them, in order."""
    starts, at = [], 0
    for _, _, tokens in items:
        starts.append(at)
        at += len(tokens)
    return starts


def select_rows(tensor: Tensor, rows: list[int]) -> Tensor:
    """`tensor[rows]`: a view when the rows are one ascending run (a decode step's logits,
    a fresh engine's table rows), else one `index_select`. Indexing with the list itself
    goes through advanced indexing, 12-30 µs a step on CPU."""
    if rows and rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0],
                                                                           rows[-1] + 1)):
        return tensor[rows[0]:rows[-1] + 1]
    return tensor.index_select(0, torch.tensor(rows, dtype=torch.long, device=tensor.device))


class ModelRunner:
    def __init__(self, model: Transformer, slabs: KVSlabs, device: torch.device,
                 max_model_len: int, rows: int = 64, compile_decode: bool = False,
                 retain_memory: bool = True,
                 max_static_rows: int | None = None,
                 snapshots: StateSnapshots | None = None,
                 block_hash: Callable[[int], int] | None = None,
                 snapshot_stride: int = 0) -> None:
        """`max_model_len`: the longest sequence served; `max_static_rows`: the most tokens a
        compiled step may have (None: any number, in several calls past the largest bucket);
        `retain_memory`: as `EngineConfig.retain_freed_memory`; `snapshots`: where a model
        with linear-attention layers keeps their states for prefix caching, under the hash
        of the block they end (`block_hash(block id)`), at each chunk's last block boundary
        and every `snapshot_stride` tokens (0: there alone)."""
        self.model, self.slabs, self.device = model, slabs, device
        self.max_static_rows = max_static_rows if max_static_rows is not None else 1 << 62
        if device.type == "cpu":  # paged decode attention, and the GEMMs' graph ops
            load_cpu_kernels()
            if retain_memory:  # a step's temporaries reuse the last step's pages
                retain_freed_memory()
        self.block_size = slabs.block_size
        # no sequence holds more blocks than the cache has: a table as wide as a config's
        # max_position_embeddings alone (1e10 of them: 320 GB) would never be filled
        self.max_blocks = min(-(-max_model_len // self.block_size),
                              slabs.scratch_slot // self.block_size)
        # each sequence's linear-attention states, by its row
        self.states = RecurrentStates(model.config, rows, device, slabs.dtype) \
            if model.config.linear_layer_count else None
        self.snapshots = snapshots if self.states is not None else None
        if self.snapshots is not None and block_hash is None:
            raise ValueError("snapshots are kept under block hashes: pass block_hash")
        self.block_hash = block_hash
        self.snapshot_stride = snapshot_stride // self.block_size * self.block_size
        # the step's snapshots, to be kept once their blocks are hashed: the sequence, the
        # boundary, the pass's spans, its key there (state row, tokens) and whether a decode
        # took it
        self._taken: list[tuple[Sequence, int, StateSpans, tuple[int, int], bool]] = []
        self._decoded: dict[Sequence, int] = {}  # each sequence's kept decode snapshot
        self._drafted: StateSpans | None = None  # the last step's, until its drafts settle
        self.graphs = DecodeGraphs(model, slabs, rows, self.max_blocks, self.states) \
            if compile_decode else None
        # the LM head of a compiled step, over its kept rows outside the graph (as vLLM's)
        self.head = model.compute_logits if model.config.final_softcap is not None \
            else bound_linear(model.lm_head)
        self.tables = torch.zeros(rows, self.max_blocks, dtype=torch.long, device=device)
        self.rows: dict[Sequence, int] = {}
        self.written: list[list[int]] = [[] for _ in range(rows)]  # host copy of each row
        self.free_rows = list(range(rows - 1, -1, -1))
        self.offsets = torch.arange(self.block_size, device=device)

    def warm_up(self, background: bool, progress: Progress | None = None) -> None:
        """Build every compiled decode step (compiled, or loaded from the cache), so that
        none is compiled under load: now, or in the `background` on a thread while the
        engine serves (`DecodeGraphs.build_in_background`); nothing to do without
        `compile_decode`. Where compiling fails (no C++ compiler for inductor, no Triton on
        a GPU) the steps run eagerly, with a warning, rather than not at all."""
        graphs = self.graphs
        if graphs is None:
            return

        def failed(error: Exception) -> None:
            log.warning("compiling the decode steps failed (%s: %s); serving eagerly, as "
                        "with --enforce-eager%s", type(error).__name__, error,
                        f" (but at batch sizes {sorted(graphs.ready)}, built by then)"
                        if graphs.ready else "")
        try:
            if background:
                graphs.build_in_background(progress, failed)
            else:
                graphs.warm_up(progress)
        except Exception as error:  # whatever the compiler stack raises
            self.graphs = None
            failed(error)

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy a full state dict into the served model in place (compiled steps keep
        reading the same tensors)."""
        if is_quantized(self.model):
            raise RuntimeError("load_weights takes full-precision weights; this engine's "
                               "linears are quantized (build an unquantized engine for training)")
        missing, unexpected = self.model.load_state_dict(dict(state_dict), strict=False)
        if self.model.config.tie_embeddings:
            missing = [name for name in missing if name != "lm_head.weight"]
        if missing or unexpected:
            raise RuntimeError(f"load_weights: missing {missing[:4]}, unexpected "
                               f"{unexpected[:4]}; pass the policy's full state_dict")

    def release(self, seq: Sequence) -> None:
        """Give a finished or aborted sequence's row back."""
        self._decoded.pop(seq, None)
        row = self.rows.pop(seq, None)
        if row is not None:
            self.written[row] = []
            self.free_rows.append(row)

    def _row(self, seq: Sequence) -> int:
        """`seq`'s row, its block table brought up to date (only what changed is written)."""
        row = self.rows.get(seq)
        if row is None:
            if not self.free_rows:
                self._reclaim()
            if not self.free_rows:
                self._grow()
            row = self.rows[seq] = self.free_rows.pop()
        blocks, known = seq.table.blocks, self.written[row]
        if blocks != known:
            start = len(known) if blocks[:len(known)] == known else 0
            self.tables[row, start:len(blocks)] = torch.tensor(blocks[start:],
                                                               device=self.device)
            self.written[row] = list(blocks)
        return row

    def _reclaim(self) -> None:
        """Free the rows of preempted sequences: one starts again from its first token (or
        a snapshot) when it is readmitted, so it needs no row before then, and the running
        ones (`max_num_seqs` at most) then never outgrow the rows the compiled steps of a
        model with linear-attention layers were built over."""
        for seq in [seq for seq in self.rows if seq.status is Status.WAITING]:
            self.release(seq)

    def _grow(self) -> None:
        old = self.tables.shape[0]
        self.tables = torch.cat([self.tables, torch.zeros_like(self.tables)])
        if self.states is not None:
            self.states.grow(2 * old)
        self.written += [[] for _ in range(old)]
        self.free_rows += list(range(2 * old - 1, old - 1, -1))

    def prepare(self, items: Seq[StepItem], slabs: KVSlabs | None = None,
                drafted: frozenset[Sequence] = frozenset(),
                ) -> tuple[Tensor, PagedBatch | StaticDecodeBatch, list[int]]:
        """The step's token row, its paged-attention view (on `slabs`, by default the
        target's), and where each item's tokens start in the row. The tokens that attend
        through their block table (decodes, and on CPU short prefill chunks) are laid out
        first. `drafted`: the sequences whose tokens end in drafts (their linear-attention
        states are settled once the drafts are verified: `settle_drafts`)."""
        self._taken = []  # a step that failed before its snapshots were kept leaves none
        for seq, _, _ in items:  # rows first: a new one may grow the states under the graphs
            if seq not in self.rows:
                self._row(seq)
        if self._static(items, slabs, drafted):
            inputs, tables, blocks = self._table_inputs(items)
            assert self.graphs is not None
            view = self._view(inputs[0], tables[:, :self.graphs.width(blocks)], static=True,
                              states=self._state_spans([(i, seq, start, 1) for i, (
                                  seq, start, _) in enumerate(items)]))
            return inputs[0, :1], view, _starts(items)
        slabs = slabs or self.slabs
        paged_context = self._paged_context(slabs)
        paged = [len(tokens) == 1 or start + len(tokens) <= paged_context
                 for _, start, tokens in items]
        order = sorted(range(len(items)), key=lambda i: not paged[i])
        num_items = sum(paged)
        laid_out = [items[i] for i in order]
        starts = [0] * len(items)
        for i, start in zip(order, _starts(laid_out), strict=True):
            starts[i] = start
        ids = [token for _, _, tokens in laid_out for token in tokens]
        num_paged = sum(len(tokens) for _, _, tokens in laid_out[:num_items])
        device = self.device
        positions = torch.empty(len(ids), dtype=torch.long, device=device)
        slots = torch.empty(len(ids), dtype=torch.long, device=device)
        tables = lens = None
        if num_paged:
            inputs, tables, blocks = self._table_inputs(laid_out[:num_items])
            positions[:num_paged], slots[:num_paged], lens = inputs[0, 1:4]
            tables = tables[:, :blocks]
        spans = []
        offset, size = num_paged, self.block_size
        for seq, start, tokens in laid_out[num_items:]:
            row, count = self._row(seq), len(tokens)
            end = start + count
            context = (self.tables[row, :(end - 1) // size + 1, None] * size
                       + self.offsets).flatten()[:end]
            positions[offset:offset + count] = torch.arange(start, end, device=device)
            slots[offset:offset + count] = context[start:end]
            spans.append(SequenceSpan(offset, count, context))
            offset += count
        states = None if slabs is not self.slabs else self._state_spans(
            [(at, seq, start, len(tokens)) for at, (seq, start, tokens) in
             zip(_starts(laid_out), laid_out, strict=True)], drafted)
        view = PagedBatch(slabs, positions, slots, num_paged, tables, lens, spans, states)
        return torch.tensor([ids], device=device), view, starts

    def _state_spans(self, items: list[tuple[int, Sequence, int, int]],
                     drafted: frozenset[Sequence] = frozenset()) -> StateSpans | None:
        """Where each sequence's tokens (at, the sequence, its first position, how many)
        lie for the linear-attention layers; None for a model without them. With
        snapshots, a sequence that starts from a cached prefix gets its states from the
        prefix's snapshot, a prefill chunk is snapshotted at the last block boundary it
        reaches and a decode at the block boundary it ends; a `drafted` sequence keeps its
        states after each token (and takes no snapshot) until `settle_drafts`."""
        if self.states is None:
            return None
        size, spans, taken = self.block_size, [], []
        for at, seq, start, count in items:
            row, cuts = self._row(seq), ()
            if self.snapshots is not None:
                if start and start == seq.table.num_cached_tokens:  # its first step
                    self.states.restore(row, self.snapshots.get(
                        self.block_hash(seq.table.blocks[start // size - 1])))
                if seq not in drafted:  # drafts may yet be rejected
                    cuts = self._cuts(start, count)
                    taken += [(seq, start + cut, row, cut, count == 1) for cut in cuts]
            spans.append((at, count, row, start == 0, cuts))
        view = StateSpans(self.states, spans, frozenset(self.rows[seq] for seq in drafted))
        self._drafted = view
        self._taken += [(seq, boundary, view, (row, cut), decode)
                        for seq, boundary, row, cut, decode in taken]
        return view

    def _cuts(self, start: int, count: int) -> tuple[int, ...]:
        """After how many of the `count` tokens from position `start` their states are
        snapshotted: the last block boundary they reach, and each multiple of the stride
        they cross."""
        end, stride = start + count, self.snapshot_stride
        boundaries = {end // self.block_size * self.block_size}
        if stride:
            boundaries |= set(range((start // stride + 1) * stride, end, stride))
        return tuple(sorted(b - start for b in boundaries if b > start))

    def settle_drafts(self, kept: Mapping[Sequence, int]) -> None:
        """Each drafted sequence's linear-attention states after the `kept[seq]` tokens of
        its step that stand (its last sampled token and the drafts accepted after it)."""
        if self.states is not None and self._drafted is not None:
            for seq, count in kept.items():
                self._drafted.settle(self.rows[seq], count)
            self._drafted = None

    def keep_snapshots(self) -> None:
        """Keep the step's snapshots under their blocks' hashes, once the scheduler has
        committed those blocks (`Scheduler.update_from_output`). A sequence's decodes keep
        one: its latest (the answer so far, which a conversation's next turn repeats) takes
        the place of the one before, so a long answer does not flush the others."""
        assert self.snapshots is not None
        for seq, boundary, view, taken, decode in self._taken:
            index = boundary // self.block_size - 1
            snapshot = view.captured.get(taken)
            if snapshot is None or index >= len(seq.table.blocks) or \
                    (key := self.block_hash(seq.table.blocks[index])) == NO_HASH:
                continue
            self.snapshots.put(key, snapshot)
            if decode:
                before = self._decoded.get(seq)
                if before is not None and before != key:
                    self.snapshots.discard(before)
                self._decoded[seq] = key
        self._taken = []

    def _paged_context(self, slabs: KVSlabs) -> int:
        """The longest context a prefill chunk attends token by token over (none off CPU)."""
        k_slab = next(slab for slab in slabs.k if len(slab))  # not a linear-attention layer's
        if not native_kernel("paged_decode", k_slab):
            return 0
        return PAGED_PREFILL_BYTES // (2 * k_slab[0].nbytes)

    def _static(self, items: Seq[StepItem], slabs: KVSlabs | None,
                drafted: frozenset[Sequence] = frozenset()) -> bool:
        """Whether a step takes the compiled path: the target's, with every token attending
        through its block table — decodes, and on CPU short prefill chunks and verified
        drafts as well — and, with `max_static_rows`, no more tokens than that; and the
        graphs it calls are built (while they build in the background, others run eager).
        With linear-attention layers, whose states a token at a time carries on, only a
        step of decodes that continue their states (no first token, no drafts) does."""
        if self.graphs is None or slabs is not None:
            return False
        decodes = all(len(tokens) == 1 for _, _, tokens in items)
        if self.states is not None and not (
                decodes and not drafted and self.graphs.states_current
                and all(start for _, start, _ in items)):
            return False
        if decodes:
            return (self.graphs.bucket(len(items)) is not None
                    and self.graphs.ready_for(len(items)))
        context = self._paged_context(self.slabs)
        rows = sum(len(tokens) for _, _, tokens in items)
        return (rows <= self.max_static_rows and self.graphs.ready_for(rows)
                and all(start + len(tokens) <= context for _, start, tokens in items))

    def prepare_decodes(self, items: Seq[StepItem], steps: int,
                        ) -> tuple[Tensor, list[PagedBatch | StaticDecodeBatch]]:
        """The first token row and the paged-attention views of `steps` decode passes over
        `items` (one token each), the k-th pass at each item's start + k, so a later pass
        costs a few tensor views. Each sequence's blocks must already hold its last pass."""
        self._taken = []
        inputs, tables, blocks = self._table_inputs(items, steps)
        static = self._static(items, None)
        if static:
            assert self.graphs is not None
            blocks = self.graphs.width(blocks)
        return inputs[0, :1], [self._view(inputs[k], tables[:, :blocks], static,
                                          self._state_spans([(i, seq, start + k, 1) for i, (
                                              seq, start, _) in enumerate(items)]))
                               for k in range(steps)]

    def _table_inputs(self, items: Seq[StepItem], steps: int = 1) -> tuple[Tensor, Tensor, int]:
        """The one builder of the inputs of tokens that attend through their block table,
        whichever way the step runs (eager, compiled, several passes): each token's id,
        position, KV slot, context length and row (its block table's, its linear-attention
        states'), for each of `steps` passes (the k-th at each item's start + k: multi-step
        decoding, a token per item), computed on the host and sent as one (steps, 5, tokens)
        tensor (a handful of small device ops per step would cost as much as a small model's
        layer); the tokens' block-table rows; and how many blocks the longest context
        spans."""
        size = self.block_size
        rows: list[int] = []
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[list[int]] = []  # each token's sequence's blocks
        for seq, start, tokens in items:
            row = self._row(seq)
            rows += [row] * len(tokens)
            blocks += [seq.table.blocks] * len(tokens)
            ids += tokens
            positions += range(start, start + len(tokens))
        passes = []
        for k in range(steps):
            at = [position + k for position in positions]
            passes.append([ids, at, [table[p // size] * size + p % size
                                     for table, p in zip(blocks, at, strict=True)],
                           [p + 1 for p in at], rows])
        last = max(positions) + steps - 1
        return (torch.tensor(passes, device=self.device), select_rows(self.tables, rows),
                last // size + 1)

    def _view(self, inputs: Tensor, tables: Tensor, static: bool,
              states: StateSpans | None = None) -> PagedBatch | StaticDecodeBatch:
        """The attention view of one pass of `_table_inputs`: every token through its table."""
        if static:
            return StaticDecodeBatch(self.slabs, inputs[1], inputs[2], tables, inputs[3],
                                     self.states, None if states is None else inputs[4], states)
        return PagedBatch(self.slabs, inputs[1], inputs[2], inputs.shape[1], tables,
                          inputs[3], [], states)

    def run(self, ids: Tensor, view: PagedBatch | StaticDecodeBatch, keep: list[int],
            model: Transformer | None = None) -> Tensor:
        """Logits of the step's rows `keep` (position indices into the token row), from
        `model` (by default the target)."""
        if isinstance(view, StaticDecodeBatch):
            assert model is None
            return self._run_static(ids[0], view, keep)
        with native_inference():
            return (model or self.model)(ids, kv_cache=view, logits_to_keep=torch.tensor(
                keep, device=self.device, dtype=torch.long)).logits[0]

    def _run_static(self, ids: Tensor, view: StaticDecodeBatch, keep: list[int]) -> Tensor:
        """A compiled step's logits of rows `keep`: the graphs give the final hidden states,
        in calls of the largest bucket's rows, in row order, when the step has more (each
        call writes its tokens' K/V before they attend, so a sequence's later tokens see its
        earlier ones, as in one call); the LM head runs on the kept rows alone. The
        linear-attention states the step snapshots are taken after it."""
        assert self.graphs is not None
        largest, inputs = self.graphs.buckets[-1], view.graph_inputs(ids)
        if ids.shape[0] <= largest:
            kept = select_rows(self.graphs.run(*inputs), keep)
        else:
            order = sorted(range(len(keep)), key=keep.__getitem__)
            parts = []
            for begin in range(0, ids.shape[0], largest):
                hidden = self.graphs.run(*(t[begin:begin + largest] for t in inputs))
                wanted = [keep[i] - begin for i in order if begin <= keep[i] < begin + largest]
                if wanted:
                    parts.append(select_rows(hidden, wanted))
            kept = torch.cat(parts)[torch.tensor(order, device=ids.device).argsort()] \
                if parts else hidden[:0]
        if view.spans is not None:
            view.spans.capture(0, view.spans.states.layers)
        return self.head(kept)
