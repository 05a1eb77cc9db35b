"""The forward work of one scheduled batch (vLLM's execute_model): every sequence's new
tokens — and any speculative drafts, cut to what a grammar takes — laid out in one row by
the `ModelRunner`, the logits of the rows that matter (each sampled position, prompt rows
that asked for log-probabilities, a draft's rows) computed on each row's LoRA adapter, the
`Sampler`'s draws, and drafts verified by the `Speculator`; or, for a run of decode steps
(multi-step decoding), several passes each fed the tokens the last one drew. What each
sequence emits comes back as `Pick`s, for the engine to commit and detokenize."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from lathe.serve.adapters import AdapterSlots
from lathe.serve.logprobs import requested_logprobs, token_logprobs
from lathe.serve.model_runner import ModelRunner, select_rows
from lathe.serve.outputs import Pick, TokenLogprob
from lathe.serve.paged_cache import PagedBatch
from lathe.serve.sampler import Sampler
from lathe.serve.scheduler import ScheduledBatch
from lathe.serve.sequence import Sequence
from lathe.serve.speculative import Speculator


class StepExecutor:
    def __init__(self, runner: ModelRunner, sampler: Sampler, speculator: Speculator | None,
                 adapters: AdapterSlots | None, device: torch.device) -> None:
        self.runner, self.sampler, self.speculator = runner, sampler, speculator
        self.adapters, self.device = adapters, device

    def release(self, seq: Sequence) -> None:
        """Free what the runner, speculator, sampler and adapters hold for `seq` (its
        adapter once, if it was admitted)."""
        self.runner.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        self.sampler.release(seq)
        if seq.adapter is not None and seq.adapter_slot >= 0:
            self.adapters.release(seq.adapter)
            seq.adapter = None

    def execute(self, batch: ScheduledBatch, steps: int) -> dict[Sequence, list[Pick]]:
        """What each sequence of `batch` that reached its end emits: from one forward pass,
        or from `steps` passes of a decode-only batch (`Scheduler.decode_run`)."""
        if steps > 1:
            return self._run_decodes([seq for seq, _ in batch.items], steps)
        return self._run(batch)

    def _run(self, batch: ScheduledBatch) -> dict[Sequence, list[Pick]]:
        """One forward pass over the scheduled tokens (and any drafts): what each sequence
        that reached its end emits."""
        drafts = self.speculator.propose(batch.items, batch.lookahead) \
            if self.speculator is not None else {}
        drafts = self.sampler.cut_drafts(drafts)
        work = []
        for seq, count in batch.items:
            start = seq.num_computed
            draft = drafts[seq].tokens if seq in drafts else []
            work.append((seq, start, seq.tokens(start, start + count) + draft))
        ids, view, starts = self.runner.prepare(work, drafted=frozenset(drafts))
        slots = None
        if self.adapters is not None:
            slots = [-1] * ids.shape[-1]
            for (seq, _, tokens), row in zip(work, starts, strict=True):
                slots[row:row + len(tokens)] = [seq.adapter_slot] * len(tokens)
        keep: list[int] = []  # rows whose logits the LM head computes
        sample_rows: list[int] = []  # of which sampled (one per sequence)
        scored: list[tuple[Sequence, int, int, int]] = []  # prompt log-probs: seq, at, from, to
        sampled: list[Sequence] = []
        verified: list[tuple[Sequence, int]] = []  # sequences with drafts, their first kept row
        for (seq, count), row in zip(batch.items, starts, strict=True):
            start, end = seq.num_computed, seq.num_computed + count
            seq.num_computed = end
            if seq.prompt_logprobs is not None:
                # position p's logits score prompt token p + 1; a recompute after
                # preemption skips the positions already scored
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(end, len(seq.prompt_ids) - 1)
                if first < last:
                    scored.append((seq, len(keep), first, last))
                    keep += range(row + first - start, row + last - start)
            if seq in drafts:
                verified.append((seq, len(keep)))
                keep += range(row, row + 1 + len(drafts[seq].tokens))
            elif end == seq.num_tokens:
                sample_rows.append(len(keep))
                keep.append(row + count - 1)
                sampled.append(seq)
        with self._adapter_rows(slots) as follow:
            if isinstance(view, PagedBatch):  # its rows' adapters follow them when it narrows
                view.follow = follow
            logits = self.runner.run(ids, view, keep)
        for seq, at, first, last in scored:
            seq.prompt_logprobs += token_logprobs(logits[at:at + last - first],
                                                  seq.prompt_ids[first + 1:last + 1],
                                                  seq.params.prompt_logprobs or 0)
        picks = dict(zip(sampled, ([pick] for pick in self.sampler.sample(
            sampled, select_rows(logits, sample_rows))), strict=True))
        if verified:
            drawn = self.sampler.draft_logits(verified, drafts, logits)
            accepted = self.speculator.verify(verified, drafts, logits, drawn)
            self.sampler.accepted(accepted)
            self.runner.settle_drafts({seq: len(tokens) for seq, tokens in accepted.items()})
            picks.update(accepted)
        return picks

    def _adapter_rows(self, slots: list[int] | None) -> contextlib.AbstractContextManager:
        """Within it, the target's token rows run on their LoRA adapters (`slots[i]`, -1
        for the base), and it gives what narrows them with a step (`AdapterSlots.rows`); a
        no-op without adapters, which gives None."""
        if slots is None or self.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.rows(slots, self.device)

    def _run_decodes(self, seqs: list[Sequence], steps: int) -> dict[Sequence, list[Pick]]:
        """`steps` decode passes over `seqs`, each fed the tokens the last one sampled
        without a trip through Python lists, and no scheduling, detokenizing or stop checks
        between them: what each sequence emits (`OutputProcessor.append` drops whatever
        follows a token that ends it)."""
        sampling = self.sampler.batch(seqs)
        starts = [seq.num_computed for seq in seqs]
        ids, views = self.runner.prepare_decodes(
            [(seq, at, seq.tokens(at, at + 1)) for seq, at in zip(seqs, starts, strict=True)],
            steps)
        rows = list(range(len(seqs)))
        params = [seq.params for seq in seqs]
        wanted = any(p.logprobs is not None for p in params)
        drawn: list[Tensor] = []
        logprobs: list[list[TokenLogprob | None]] = []
        adapter_slots = [seq.adapter_slot for seq in seqs] if self.adapters else None
        for view in views:
            with self._adapter_rows(adapter_slots):
                logits = self.runner.run(ids, view, rows)
            tokens = self.sampler.draw(seqs, logits, sampling)
            drawn.append(tokens)
            logprobs.append(requested_logprobs(params, logits, tokens.tolist()) if wanted
                            else [None] * len(seqs))
            ids = tokens[None]
        for seq, at in zip(seqs, starts, strict=True):
            seq.num_computed = at + 1  # `LLMEngine.step` counts the later passes with the tokens
        by_step = torch.stack(drawn).tolist()
        return {seq: [(by_step[k][i], logprobs[k][i]) for k in range(steps)]
                for i, seq in enumerate(seqs)}
