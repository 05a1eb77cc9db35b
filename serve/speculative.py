"""Speculative decoding: cheap guesses of a sequence's next tokens, checked by one target
forward over all of them (decode is memory-bound, so verifying k tokens costs about one
step).

`Speculator` is what the engine holds: the proposer, the verification of each step's
drafts, and the counters vLLM reports. Two proposers: `NgramProposer` (prompt lookup: the
tokens that followed the latest earlier occurrence of the sequence's last n tokens) and
`DraftModelProposer` (a small model that shares the target's tokenizer, e.g. the student
`lathe distill` writes; its KV lives in the target's block ids, see
`lathe.serve.model_runner`). `verify` keeps the longest acceptable prefix of a draft: for
greedy rows the drafts the target's own argmax agrees with; for sampled rows the rejection
sampler of Leviathan et al. (2023) and Chen et al. (2023) — accept draft x with probability
min(1, p(x) / q(x)), on rejection draw from norm(max(p - q, 0)) — so the output
distribution is the target's exactly. Then one more token comes from the target for free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from lathe.data.tokenizer import vocabulary_difference
from lathe.model.checkpoint import CheckpointError
from lathe.model.transformer import Transformer
from lathe.serve.config import QuantMode, SpeculativeConfig
from lathe.serve.logprobs import sampled_logprobs
from lathe.serve.model_runner import ModelRunner, StepItem
from lathe.serve.outputs import Pick
from lathe.serve.paged_cache import KVSlabs
from lathe.serve.quant import load_serving_model, serving_tokenizer
from lathe.serve.request_checks import RequestError
from lathe.serve.sampling import (
    SamplingBatch,
    SamplingRow,
    exponential_race,
    processed_logits,
    sample_with_probs,
    sampling_probs,
)
from lathe.serve.sequence import Sequence


@dataclass
class Draft:
    """A sequence's proposed next tokens and, for a draft model, the distribution each was
    drawn from ((len(tokens), vocab); None: each token is certain, as prompt lookup's)."""

    tokens: list[int]
    probs: Tensor | None = None


def history_rows(seq: Sequence, drafts: list[int]) -> list[SamplingRow]:
    """Sampling rows for the positions after each prefix of `drafts` (what penalties see)."""
    return [SamplingRow(seq.params, seq.prompt_ids, seq.output_ids + drafts[:j], seq.generator)
            for j in range(len(drafts) + 1)]


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seq: Sequence, limit: int) -> Draft | None:
        """`limit` tokens that followed the latest earlier occurrence of the longest
        matching suffix (`max_n` down to `min_n` tokens), the copy continued periodically
        where it reaches the end; None without a match."""
        tokens = np.asarray(seq.token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # every window that ends before the last token, against the last n tokens
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                draft = tokens[start:start + limit].tolist()
                period = len(tokens) - start
                while len(draft) < limit:  # the copy runs past the end: it repeats (LZ77)
                    draft.append(draft[len(draft) - period])
                return Draft(draft)
        return None


class DraftModelProposer:
    """A draft model decoding k tokens ahead over its own KV slabs in the target's blocks.

    The draft's KV of a sequence is valid up to `extent(seq)` tokens: what it has written,
    cut back to what the target keeps (rejected drafts roll both back). Each step it first
    catches up on every scheduled sequence's new tokens (prefill chunks included, so a
    block the prefix cache hands out holds the draft's KV too), then decodes k - 1 more.
    """

    def __init__(self, model: Transformer, runner: ModelRunner, slabs: KVSlabs) -> None:
        self.model, self.runner, self.slabs = model.eval(), runner, slabs
        self.max_len = model.config.max_seq_len
        self.written: dict[Sequence, tuple[int, int]] = {}  # seq -> (tokens, preemptions)

    def release(self, seq: Sequence) -> None:
        self.written.pop(seq, None)

    def extent(self, seq: Sequence) -> int:
        """Leading tokens of `seq` whose draft KV is valid."""
        written, preemptions = self.written.get(seq, (seq.num_computed, seq.num_preemptions))
        if preemptions != seq.num_preemptions:  # re-admitted: only its cached prefix holds
            written = seq.num_computed
        return min(written, seq.num_computed)

    def propose(self, items: list[tuple[Sequence, int]],
                limits: dict[Sequence, int]) -> dict[Sequence, Draft]:
        """Drafts for the decoding sequences in `limits` (at most that many tokens each),
        after catching the draft's KV up with every item of the step."""
        first: list[StepItem] = []
        for seq, count in items:
            start, end = self.extent(seq), seq.num_computed + count
            if end > self.max_len:  # past the draft's context: the target decodes alone
                limits.pop(seq, None)
                continue
            if seq in limits:
                limits[seq] = min(limits[seq], self.max_len - end + 1)
            first.append((seq, start, seq.tokens(start, end)))
            self.written[seq] = (end, seq.num_preemptions)
        drafts = {seq: Draft([]) for seq in limits}
        probs: dict[Sequence, list[Tensor | None]] = {seq: [] for seq in limits}
        step = first
        while step:
            active = [seq for seq, _, _ in step if seq in drafts]
            ids, view, starts = self.runner.prepare(step, self.slabs)
            at = {seq: row + len(tokens) - 1
                  for (seq, _, tokens), row in zip(step, starts, strict=True)}
            logits = self.runner.run(ids, view, [at[seq] for seq in active], self.model)
            if not active:
                break
            batch = SamplingBatch([history_rows(seq, drafts[seq].tokens)[-1]
                                   for seq in active], logits.device)
            picked, row_probs = sample_with_probs(logits, batch)
            tokens = picked.tolist()
            step = []
            for i, seq in enumerate(active):
                drafts[seq].tokens.append(tokens[i])
                probs[seq].append(row_probs[i])
                if len(drafts[seq].tokens) < limits[seq]:
                    position = seq.num_tokens + len(drafts[seq].tokens) - 1
                    step.append((seq, position, [tokens[i]]))
                    self.written[seq] = (position + 1, seq.num_preemptions)
        for seq, draft in drafts.items():
            if not seq.params.greedy:
                draft.probs = torch.stack([p for p in probs[seq] if p is not None])
        return drafts


def verify(logits: Tensor, seqs: list[Sequence], drafts: list[Draft]) -> list[list[int]]:
    """The tokens each sequence emits: the accepted prefix of its draft, then one token from
    the target. `logits` holds, per sequence in order, len(draft) + 1 target rows: the
    positions of its last token and of each draft token."""
    rows: list[SamplingRow] = []
    for seq, draft in zip(seqs, drafts, strict=True):
        rows += history_rows(seq, draft.tokens)
    batch = SamplingBatch(rows, logits.device)
    processed = processed_logits(logits, batch)
    argmax = processed.argmax(dim=-1).tolist()
    sampled = (batch.temperature > 0).nonzero()[:, 0] if not batch.all_greedy else None
    probs = sampling_probs(processed, batch, sampled) if sampled is not None else None
    emitted: list[list[int]] = []
    offset = prob_offset = 0
    for seq, draft in zip(seqs, drafts, strict=True):
        k = len(draft.tokens)
        if seq.params.greedy:
            accepted = 0
            while accepted < k and draft.tokens[accepted] == argmax[offset + accepted]:
                accepted += 1
            emitted.append(draft.tokens[:accepted] + [argmax[offset + accepted]])
        else:
            assert probs is not None
            target = probs[prob_offset:prob_offset + k + 1]
            emitted.append(_rejection_sample(target, draft, seq.generator))
            prob_offset += k + 1
        offset += k + 1
    return emitted


def _rejection_sample(target: Tensor, draft: Draft,
                      generator: torch.Generator | None) -> list[int]:
    """Accept draft token x_j while u_j · q(x_j) < p(x_j); at the first rejection draw from
    max(p - q, 0), else the bonus token from the last row of p."""
    k = len(draft.tokens)
    drafted = torch.tensor(draft.tokens, device=target.device, dtype=torch.long)
    picked = target[torch.arange(k, device=target.device), drafted]
    if draft.probs is None:
        chance = torch.ones_like(picked)
    else:
        chance = draft.probs[torch.arange(k, device=target.device), drafted]
    uniform = torch.rand(k, device=target.device, generator=generator)
    accepted_mask = (uniform * chance < picked).tolist()
    accepted = next((j for j, ok in enumerate(accepted_mask) if not ok), k)
    if accepted == k:
        last = target[k]
    elif draft.probs is None:
        last = target[accepted].clone()
        last[draft.tokens[accepted]] = 0.0
    else:
        last = (target[accepted] - draft.probs[accepted]).clamp_min(0.0)
    token = int(exponential_race(last[None], [generator])[0])
    return draft.tokens[:accepted] + [token]


class Speculator:
    """Speculative decoding as the engine uses it: drafts for a step's decoding sequences
    (`propose`), what each drafted sequence emits once the target has scored them
    (`verify`), and the counters (`stats`)."""

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner,
                 draft_model: Transformer | None, draft_slabs: KVSlabs | None,
                 max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(config) if config.method == "ngram" else None
        self.drafter = None if draft_model is None or draft_slabs is None else \
            DraftModelProposer(draft_model, runner, draft_slabs)
        self.steps = self.draft_tokens = self.accepted_tokens = 0

    def release(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.release(seq)

    def cacheable(self, seq: Sequence, computed: int) -> int:
        """How many of `seq`'s computed tokens may enter the prefix cache: only blocks the
        draft's KV covers too."""
        return min(computed, self.drafter.extent(seq)) if self.drafter is not None \
            else computed

    def propose(self, items: list[tuple[Sequence, int]],
                lookahead: dict[Sequence, int]) -> dict[Sequence, Draft]:
        """Draft tokens for the step's decoding sequences, as many as each has room for
        (its lookahead slots, its max_tokens, the context)."""
        limits = {}
        for seq, room in lookahead.items():
            limit = min(room, seq.params.max_tokens - len(seq.output_ids) - 1,
                        self.max_model_len - seq.num_tokens - 1)
            if limit > 0:
                limits[seq] = limit
        if self.drafter is not None:
            drafts = self.drafter.propose(items, limits)
        else:
            assert self.ngram is not None
            found = ((seq, self.ngram.propose(seq, limit)) for seq, limit in limits.items())
            drafts = {seq: draft for seq, draft in found if draft is not None}
        self.steps += len(drafts)
        self.draft_tokens += sum(len(draft.tokens) for draft in drafts.values())
        return drafts

    def verify(self, verified: list[tuple[Sequence, int]], drafts: dict[Sequence, Draft],
               logits: Tensor, drawn: Tensor | None = None) -> dict[Sequence, list[Pick]]:
        """What each drafted sequence emits (accepted drafts, then one target token), with
        the log-probs of the rows that scored them when the request asked for them;
        `verified` holds each drafted sequence and its first row in `logits`. `drawn`:
        the logits to verify against where they differ from the model's (a structured
        output's masks); log-probs stay the model's own."""
        if not verified:
            return {}
        seqs = [seq for seq, _ in verified]
        rows = [[at + j for j in range(len(drafts[seq].tokens) + 1)] for seq, at in verified]
        drawn = logits if drawn is None else drawn
        emitted = verify(drawn[[row for group in rows for row in group]], seqs,
                         [drafts[seq] for seq in seqs])
        picks = {}
        for seq, group, tokens in zip(seqs, rows, emitted, strict=True):
            self.accepted_tokens += len(tokens) - 1
            logprobs: list = [None] * len(tokens)
            if seq.params.logprobs is not None:
                logprobs = sampled_logprobs(logits[group[:len(tokens)]], tokens,
                                            [seq.params] * len(tokens))
            picks[seq] = list(zip(tokens, logprobs, strict=True))
        return picks

    def stats(self) -> dict[str, float]:
        """Drafting steps, draft tokens proposed and accepted, the acceptance rate and the
        mean tokens a drafting step emits (vLLM's mean acceptance length)."""
        steps, drafted, accepted = self.steps, self.draft_tokens, self.accepted_tokens
        return {"spec_decode_num_drafts": steps, "spec_decode_num_draft_tokens": drafted,
                "spec_decode_num_accepted_tokens": accepted,
                "spec_decode_acceptance_rate": accepted / drafted if drafted else 0.0,
                "spec_decode_mean_acceptance_length": 1 + accepted / steps if steps else 0.0}


def check_draft(model: Transformer, draft: Transformer | None,
                 speculative: SpeculativeConfig | None) -> None:
    wants_draft = speculative is not None and speculative.method == "draft"
    if wants_draft and draft is None:
        raise RequestError("speculative method 'draft' needs a draft model; pass draft_model "
                           "(or --draft PATH)")
    if draft is None:
        return
    if not wants_draft:
        raise RequestError("a draft model was given but speculative decoding is not set to "
                           "method 'draft'; set EngineConfig.speculative")
    if draft.config.linear_layer_count:
        raise RequestError("the draft model has linear-attention layers (Qwen3.5's), whose "
                           "states its drafting would advance past what the target accepts; "
                           "draft with an attention-only model or with prompt lookup "
                           "(method 'ngram')")
    if draft.config.vocab_size != model.config.vocab_size:
        raise RequestError(f"the draft model's vocab_size {draft.config.vocab_size} differs "
                           f"from the target's {model.config.vocab_size}; a draft must share "
                           "the target's tokenizer (distill it from the target)")


def load_draft(path: Path, speculative: SpeculativeConfig | None, tokenizer: Tokenizer | None,
               quantize: QuantMode | None, dtype: torch.dtype | None,
               device: torch.device | str | None) -> Transformer | None:
    """The draft model that speculative method "draft" names, loaded as the target at
    `path` is and checked to share its tokenizer; None for any other method."""
    if speculative is None or speculative.method != "draft":
        return None
    if speculative.draft is None:
        raise CheckpointError("speculative method 'draft' needs the draft checkpoint "
                              "(--draft PATH)")
    draft_path = Path(speculative.draft)
    draft = load_serving_model(draft_path, quantize=quantize, dtype=dtype, device=device)
    check_same_tokenizer(path, draft_path, tokenizer,
                         serving_tokenizer(draft_path, draft.config.vocab_size))
    return draft


def check_same_tokenizer(path: Path, draft_path: Path, tokenizer: Tokenizer | None,
                          draft: Tokenizer | None) -> None:
    """A draft's token ids mean something to the target only under the same tokenizer."""
    if tokenizer is None and draft is None:
        return
    differ = ["one checkpoint has no tokenizer.json"] if tokenizer is None or draft is None \
        else vocabulary_difference(tokenizer, draft)
    if differ:
        raise CheckpointError(f"{draft_path}/tokenizer.json is not {path}/tokenizer.json "
                              f"({differ}); a draft must share the target's tokenizer "
                              "(distill it from the target, or copy the tokenizer folder)")
