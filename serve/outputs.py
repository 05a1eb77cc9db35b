"""What a request sees of its sequences: each step's `SequenceDelta` (tokens, text,
log-probs, finish reason) and the `Completion` they add up to, and the `OutputProcessor`
that makes deltas from sampled tokens — incremental detokenization (special tokens kept
or skipped as the request asks), stop strings across token boundaries (not before
`min_tokens`), stop tokens, EOS, max_tokens and the context limit."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from lathe.serve.detokenize import IncrementalDetokenizer
from lathe.serve.sampling_params import SamplingParams
from lathe.serve.sequence import Sequence
from lathe.serve.stop import StopMatcher


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this position, best first
    rank: int | None = None  # 1 + how many tokens were more likely (where computed)


Pick = tuple[int, TokenLogprob | None]  # a sampled token and, if asked for, its log-probs


@dataclass
class SequenceDelta:
    """What one sequence gained in one step (its last one carries `finish_reason`)."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # on the first delta of a request that asked for them: one entry per prompt token,
    # None for the first (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # why the sequence failed alone (finish_reason "error")
    weight_version: int = 0  # of the weights that drew these tokens (`Sequence`'s)

    def then(self, later: SequenceDelta) -> SequenceDelta | None:
        """This delta and the same sequence's next as one (what a client reading both at
        once sees), or None where they do not join: another sequence, or this one ended."""
        if (later.request_id, later.index) != (self.request_id, self.index) \
                or self.finish_reason is not None or later.prompt_logprobs is not None:
            return None
        return SequenceDelta(self.request_id, self.index, self.token_ids + later.token_ids,
                             self.text + later.text, self.logprobs + later.logprobs,
                             later.finish_reason, later.num_prompt_tokens,
                             later.num_cached_tokens, self.prompt_logprobs, later.error,
                             later.weight_version)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    weight_version: int = 0  # of the weights that drew it

    def add(self, delta: SequenceDelta) -> None:
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.weight_version = delta.weight_version


@dataclass
class Completion:
    request_id: str
    prompt_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: SequenceDelta) -> None:
        self.outputs[delta.index].add(delta)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


class _TextState:
    """Detokenizer and stop-string matcher of one sequence."""

    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens) \
            if tokenizer is not None else None
        self.stop = StopMatcher(params.stop, params.include_stop_str_in_output)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int],
                 max_model_len: int) -> None:
        self.tokenizer, self.eos_token_ids, self.max_model_len = (tokenizer, eos_token_ids,
                                                                  max_model_len)
        self._text: dict[Sequence, _TextState] = {}
        self.generation_tokens_total = 0

    def add(self, seq: Sequence) -> None:
        self._text[seq] = _TextState(self.tokenizer, seq.params)

    def remove(self, seq: Sequence) -> None:
        self._text.pop(seq, None)

    def append(self, seq: Sequence, picks: list[Pick]) -> SequenceDelta:
        """Give `seq` the step's tokens, one at a time, until one of them finishes it (the
        rest are dropped); the delta's `finish_reason` says whether and why it ended."""
        params, state = seq.params, self._text[seq]
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        text, reason = "", None
        for token, logprob in picks:
            seq.output_ids.append(token)
            tokens.append(token)
            if logprob is not None:
                logprobs.append(logprob)
            self.generation_tokens_total += 1
            special = token in self.eos_token_ids or token in params.stop_token_ids
            if token in params.stop_token_ids or (token in self.eos_token_ids
                                                  and not params.ignore_eos):
                reason = "stop"
            if state.detokenizer is not None and not special:
                armed = len(seq.output_ids) >= params.min_tokens
                text += state.stop.feed(state.detokenizer.step(token), armed)
                if state.stop.stopped:
                    reason = "stop"
            if reason is None and (len(seq.output_ids) >= params.max_tokens
                                   or seq.num_tokens >= self.max_model_len):
                reason = "length"
            if reason is not None:
                break
        if reason is not None:
            text += state.stop.flush()
            self.remove(seq)
        first = len(seq.output_ids) == len(tokens)
        return SequenceDelta(seq.request_id, seq.index, tokens, text, logprobs, reason,
                             len(seq.prompt_ids), seq.table.num_cached_tokens,
                             seq.prompt_logprobs if first else None,
                             weight_version=seq.weight_version)

    def fail(self, seq: Sequence, error: str) -> SequenceDelta:
        """`seq`'s last delta when it fails alone (its constraint broke): no tokens,
        finish_reason "error" and the reason."""
        self.remove(seq)
        return SequenceDelta(seq.request_id, seq.index, [], "", [], "error", len(seq.prompt_ids),
                             seq.table.num_cached_tokens, error=error,
                             weight_version=seq.weight_version)
