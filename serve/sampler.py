"""The engine's sampler: each step's tokens drawn in one batched pass over the kept rows
(`lathe.serve.sampling`: penalties, temperature, top-k/p, min-p, seeded generators), with
the grammar masks of rows that asked for a structured output (`lathe.serve.structured`)
applied first and their matchers fed what was drawn — drafts cut to what a grammar takes
and verified under its masks — and the log-probs of the rows that asked for them.

A matcher that fails on a token its own mask allowed (llguidance's lexer limits) breaks its
sequence alone: the reason waits in `broken` for the engine to end that sequence with
finish_reason "error"; the step goes on."""

from __future__ import annotations

import threading

import torch
from tokenizers import Tokenizer
from torch import Tensor

from lathe.serve.constraints import Constraints, constrain
from lathe.serve.logprobs import requested_logprobs
from lathe.serve.outputs import Pick
from lathe.serve.sampling import SamplingBatch, SamplingRow, sample
from lathe.serve.sequence import Sequence
from lathe.serve.speculative import Draft
from lathe.serve.structured import GrammarError, grammar_compiler


class Sampler:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: set[int],
                 device: torch.device) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.device = device
        self._constraints: Constraints | None = None  # built by the first structured request
        self._lock = threading.Lock()  # a server's threads may build it
        self.broken: dict[Sequence, str] = {}

    @property
    def constraints(self) -> Constraints:
        """The structured-output matchers over this checkpoint's tokenizer (built on first
        use: llguidance reads the whole vocabulary)."""
        with self._lock:
            if self._constraints is None:
                self._constraints = Constraints(grammar_compiler(
                    self.tokenizer, self.vocab_size, self.eos_token_ids))
            return self._constraints

    def release(self, seq: Sequence) -> None:
        if self._constraints is not None:
            self._constraints.release(seq)

    def batch(self, seqs: list[Sequence]) -> SamplingBatch:
        return SamplingBatch([SamplingRow(seq.params, seq.prompt_ids, seq.output_ids,
                                          seq.generator) for seq in seqs], self.device)

    def sample(self, seqs: list[Sequence], logits: Tensor) -> list[Pick]:
        """Every sampled row of the step in one batched draw, and the log-probs of the rows
        that asked for them, of the model's own distribution, in one more pass."""
        tokens = self.draw(seqs, logits, self.batch(seqs)).tolist()
        return list(zip(tokens, requested_logprobs([seq.params for seq in seqs], logits,
                                                   tokens), strict=True))

    def draw(self, seqs: list[Sequence], logits: Tensor, sampling: SamplingBatch) -> Tensor:
        """One token per row; rows with a structured output drawn from what it allows next,
        and their matchers fed the draw (which brings those rows' tokens to the host: a
        multi-step run with constrained rows waits on each pass)."""
        constrained = [i for i, seq in enumerate(seqs) if seq.params.structured is not None]
        if not constrained:
            return sample(logits, sampling)
        allowed = self.constraints.allowed_mask([seqs[i] for i in constrained])
        tokens = sample(constrain(logits, constrained, allowed), sampling)
        for i, token in zip(constrained, tokens[constrained].tolist(), strict=True):
            self.advance(seqs[i], token)
        return tokens

    def advance(self, seq: Sequence, token: int) -> None:
        """Feed a constrained sequence's matcher its token; a failure breaks that sequence
        alone (`broken`), never the step."""
        if seq in self.broken:
            return
        try:
            self.constraints.advance(seq, token)
        except GrammarError as error:
            self.broken[seq] = f"the structured output could not go on: {error}"

    def cut_drafts(self, drafts: dict[Sequence, Draft]) -> dict[Sequence, Draft]:
        """Drafts of constrained sequences cut to what their grammar takes (a sequence left
        with none samples as usual)."""
        if self._constraints is None:
            return drafts
        kept = {}
        for seq, draft in drafts.items():
            if seq.params.structured is not None:
                n = self.constraints.valid_prefix(seq, draft.tokens)
                if n < len(draft.tokens):
                    draft = Draft(draft.tokens[:n], None if draft.probs is None
                                  else draft.probs[:n])
            if draft.tokens or seq.params.structured is None:
                kept[seq] = draft
        return kept

    def draft_logits(self, verified: list[tuple[Sequence, int]], drafts: dict[Sequence, Draft],
                     logits: Tensor) -> Tensor | None:
        """The logits a verification draws from where constrained sequences' drafts are
        checked against their grammar's masks along the draft (None: no constrained one)."""
        constrained = [(seq, at) for seq, at in verified if seq.params.structured is not None]
        if not constrained:
            return None
        rows = [row for seq, at in constrained
                for row in range(at, at + len(drafts[seq].tokens) + 1)]
        masks = torch.cat([self.constraints.draft_masks(seq, drafts[seq].tokens)
                           for seq, _ in constrained])
        return constrain(logits, rows, masks)

    def accepted(self, picks: dict[Sequence, list[Pick]]) -> None:
        """Feed constrained sequences' matchers the tokens a verification accepted."""
        for seq, emitted in picks.items():
            if seq.params.structured is not None:
                for token, _ in emitted:
                    self.advance(seq, token)
