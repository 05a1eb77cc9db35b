"""Sampling: the per-request parameters (OpenAI names and vLLM extras) and the batched
transforms and draw that pick one token for every row of a step at once.

A request with a structured output (`lathe.serve.structured`) has its disallowed tokens
at -inf before anything else; so, as in vLLM, do the tokens outside `allowed_token_ids`,
the last token of a `bad_words` sequence whose other tokens the output ends with, and EOS
and the stop tokens while the output is shorter than `min_tokens`. Then, as in vLLM and
HF: penalties on the raw logits
(repetition divides positive logits and multiplies negative ones for every token seen in
prompt or output; presence and frequency subtract per output token), then the request's
`logit_bias`, then temperature, then top-k, top-p and min-p masks (-inf), then a draw —
from the request's own seeded generator when it has a seed — or the argmax when the
temperature is 0.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lathe.kernels.argmax import greedy_argmax

if TYPE_CHECKING:
    from lathe.serve.structured import StructuredOutput


class SamplingError(ValueError):
    """A sampling parameter outside its allowed range (the message names field and range)."""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refuse(name: str, value: object, allowed: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise SamplingError(f"{name}={shown} must be {allowed}")


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_STOP, MAX_STOP_CHARS = 16, 256  # stop matching runs per generated token
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 256  # token sequences a request bans, each at most MAX_BAD_WORD_TOKENS
MAX_BAD_WORD_TOKENS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_LOGPROBS = 20
# Below this a temperature means greedy, as in vLLM: dividing logits by 1e-40 overflows
# them to inf, and their softmax is NaN.
TEMPERATURE_EPSILON = 1e-5


@dataclass(frozen=True)
class Bound:
    """The range a numeric parameter must lie in (`low_open`: the low end is excluded)."""

    low: float
    high: float
    low_open: bool = False

    def holds(self, value: float) -> bool:
        # NaN compares false both ways, so it never holds
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def __str__(self) -> str:
        low, high = (int(v) if float(v).is_integer() else v for v in (self.low, self.high))
        return f"in {'(' if self.low_open else '['}{low}, {high}]"


# Every numeric request parameter and the range an engine tensor can hold and a user could
# mean (vLLM's limits); the server's request schema and `SamplingParams` both check these.
BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1, INT32_MAX),
    "min_tokens": Bound(0, INT32_MAX),
    "temperature": Bound(0, 2),
    "top_p": Bound(0, 1, low_open=True),
    "top_k": Bound(-1, INT32_MAX),  # -1 or 0: off
    "min_p": Bound(0, 1),
    "repetition_penalty": Bound(0, 2, low_open=True),
    "presence_penalty": Bound(-2, 2),
    "frequency_penalty": Bound(-2, 2),
    "seed": Bound(INT64_MIN, INT64_MAX),
    "n": Bound(1, 16),
    "logprobs": Bound(0, MAX_LOGPROBS),
    "prompt_logprobs": Bound(0, MAX_LOGPROBS),
    "logit_bias": Bound(-100, 100),  # each bias; the token ids are checked as token ids
    "token_id": Bound(0, INT32_MAX),  # any token id a request names
}


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top-N log-probabilities per generated token
    # log-probs of softmax(logits / temperature), the distribution top-k/p then cut and a
    # trainer recomputes (GRPO), rather than the model's own (OpenAI's and vLLM's default)
    logprobs_at_temperature: bool = False
    prompt_logprobs: int | None = None  # top-N log-probabilities per prompt token
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to logits
    structured: StructuredOutput | None = None  # what the output must match
    min_tokens: int = 0  # EOS, stop tokens and stop strings are held off until this many
    bad_words_ids: list[list[int]] = field(default_factory=list)  # token sequences banned
    allowed_token_ids: list[int] | None = None  # None: all; else only these may be drawn
    include_stop_str_in_output: bool = False  # a matched stop string ends the text
    skip_special_tokens: bool = True  # special tokens left out of the text
    # what min_tokens holds back: the engine's EOS ids and stop_token_ids (the engine fills it)
    min_tokens_stop_ids: tuple[int, ...] = ()
    # the prompt is scored (completions' echo with max_tokens=0): the one token drawn is
    # dropped, and since it is never fed back it needs no position or KV slot
    score_only: bool = False

    def __post_init__(self) -> None:
        for name, bound in BOUNDS.items():
            value = getattr(self, name, None)
            if name in ("logit_bias", "token_id") or value is None:
                continue
            if not _number(value) or not bound.holds(value):
                _refuse(name, value, str(bound))
        token_id = BOUNDS["token_id"]
        if not (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(
                _number(t) and token_id.holds(t) for t in self.stop_token_ids)):
            _refuse("stop_token_ids", self.stop_token_ids,
                    f"at most {MAX_STOP_TOKEN_IDS} token ids, each {token_id}")
        if not (len(self.logit_bias) <= MAX_LOGIT_BIAS and all(
                _number(t) and token_id.holds(t) and _number(v) and BOUNDS["logit_bias"].holds(v)
                for t, v in self.logit_bias.items())):
            _refuse("logit_bias", self.logit_bias,
                    f"a map of at most {MAX_LOGIT_BIAS} token ids to a bias "
                    f"{BOUNDS['logit_bias']}")
        if self.score_only and self.max_tokens != 1:
            _refuse("max_tokens", self.max_tokens, "1 when only the prompt is scored "
                    "(score_only: the one token drawn is dropped)")
        if self.min_tokens > self.max_tokens:
            _refuse("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        if not (len(self.bad_words_ids) <= MAX_BAD_WORDS and all(
                isinstance(ids, list) and 0 < len(ids) <= MAX_BAD_WORD_TOKENS
                and all(_number(t) and token_id.holds(t) for t in ids)
                for ids in self.bad_words_ids)):
            _refuse("bad_words", self.bad_words_ids,
                    f"at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_TOKENS} tokens each")
        if self.allowed_token_ids is not None and not (
                0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
                and all(_number(t) and token_id.holds(t) for t in self.allowed_token_ids)):
            _refuse("allowed_token_ids", self.allowed_token_ids,
                    f"1 to {MAX_ALLOWED_TOKEN_IDS} token ids, each {token_id}")
        if not (len(self.stop) <= MAX_STOP and all(
                isinstance(text, str) and len(text) <= MAX_STOP_CHARS for text in self.stop)):
            _refuse("stop", self.stop,
                    f"at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each")
        if self.temperature < TEMPERATURE_EPSILON:
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether penalties, a logit bias or banned tokens change the logits before
        sampling (and so depend on the tokens drawn so far)."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or self.logit_bias or self.min_tokens
                    or self.bad_words_ids or self.allowed_token_ids is not None)

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: the argmax of the whole batch can stand in for it."""
        return self.greedy and not self.penalized

    def generator(self, device: torch.device | str, index: int) -> torch.Generator | None:
        """The seeded generator of the request's `index`-th sequence (None without a seed)."""
        if self.seed is None:
            return None
        return torch.Generator(device).manual_seed((self.seed + index) % 2**64)


@dataclass
class SamplingRow:
    """One sequence's share of a step's sampling: its parameters, what it has seen, and its
    seeded generator (None: the step's shared randomness)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None = None


class SamplingBatch:
    """A step's rows as tensors, so every row is transformed and drawn in one batched pass
    (vLLM's sampler): per-row temperature, top-k, top-p and min-p; penalties and logit
    bias only on the rows that ask for them."""

    def __init__(self, rows: list[SamplingRow], device: torch.device | str) -> None:
        self.rows, self.device = rows, device
        params = [row.params for row in rows]
        self.all_plain_greedy = all(p.plain_greedy for p in params)
        self.all_greedy = all(p.greedy for p in params)
        self.penalized = [i for i, p in enumerate(params) if p.penalized]

    # the per-row columns are built only for a step that samples (greedy steps never need them)
    def _column(self, values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    @functools.cached_property
    def temperature(self) -> Tensor:
        return self._column([row.params.temperature for row in self.rows], torch.float32)

    @functools.cached_property
    def top_k(self) -> Tensor:
        return self._column([max(row.params.top_k, 0) for row in self.rows], torch.long)

    @functools.cached_property
    def top_p(self) -> Tensor:
        return self._column([row.params.top_p for row in self.rows], torch.float32)

    @functools.cached_property
    def min_p(self) -> Tensor:
        return self._column([row.params.min_p for row in self.rows], torch.float32)


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition (prompt + output), presence and frequency (output only) penalties, then
    the logit bias, on the (B, vocab) rows that ask for them."""
    logits = logits.clone()
    for i in batch.penalized:
        row = batch.rows[i]
        logits[i] = _penalize_row(logits[i], row.params, row.prompt_ids, row.output_ids)
    return logits


def banned_tokens(params: SamplingParams, output_ids: Sequence[int]) -> list[int]:
    """The tokens a row may not draw next: EOS and stop tokens before `min_tokens`, and
    the last token of each bad word whose earlier tokens end the output (vLLM's rules)."""
    banned = list(params.min_tokens_stop_ids) if len(output_ids) < params.min_tokens else []
    for word in params.bad_words_ids:
        prefix = word[:-1]
        if not prefix or list(output_ids[len(output_ids) - len(prefix):]) == prefix:
            banned.append(word[-1])
    return banned


def _penalize_row(logits: Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                  output_ids: Sequence[int]) -> Tensor:
    if params.allowed_token_ids is not None:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[torch.tensor(params.allowed_token_ids, device=logits.device)] = True
        logits.masked_fill_(~keep, float("-inf"))
    banned = banned_tokens(params, output_ids)
    if banned:
        logits[torch.tensor(banned, device=logits.device)] = float("-inf")
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device),
                                minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device,
                                    dtype=logits.dtype)
    return logits


def mask_logits(logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Per row of (B, vocab) logits, set to -inf every token outside its top-k (0: off; ties
    at the k-th value stay), outside the smallest set whose probability reaches its top_p
    (the most likely token always stays), or below its min_p × the top probability."""
    vocab = logits.shape[-1]
    cut_k = (top_k > 0) & (top_k < vocab)
    if bool(cut_k.any()):
        ordered = logits.sort(dim=-1, descending=True).values
        kth = ordered.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])
        logits = logits.masked_fill(cut_k[:, None] & (logits < kth), float("-inf"))
    cut_p = top_p < 1.0
    if bool(cut_p.any()):
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = (probs.cumsum(-1) - probs >= top_p[:, None]) & cut_p[:, None]  # mass before it
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop),
                                    float("-inf"))
    if bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)
        floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def processed_logits(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """fp32 logits after each row's penalties and logit bias: greedy rows take their argmax."""
    logits = logits.float()
    return apply_penalties(logits, batch) if batch.penalized else logits


def sampling_probs(logits: Tensor, batch: SamplingBatch, rows: Tensor) -> Tensor:
    """The distribution each of `rows` (temperature > 0) draws from, given processed
    logits: temperature, then the top-k, top-p and min-p masks, then softmax."""
    scaled = logits[rows] / batch.temperature[rows, None]
    masked = mask_logits(scaled, batch.top_k[rows], batch.top_p[rows], batch.min_p[rows])
    return torch.softmax(masked, dim=-1)


def exponential_race(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One draw per row of (R, vocab) probabilities (unnormalized is fine): argmax(p / q),
    q ~ Exp(1), each row's q from its own generator when it has one."""
    noise = torch.empty_like(probs).exponential_()
    for j, generator in enumerate(generators):
        if generator is not None:
            noise[j].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def sample(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """One token id per row of (B, vocab) logits under each row's parameters: the argmax
    for temperature 0, else a draw by the exponential race — a sample from p that lets
    each seeded row draw from its own generator, so a seeded sequence gets the same tokens
    whatever else shares its step."""
    if batch.all_plain_greedy:
        return greedy_argmax(logits)
    return sample_with_probs(logits, batch)[0]


def sample_with_probs(logits: Tensor, batch: SamplingBatch) -> tuple[Tensor, list[Tensor | None]]:
    """`sample`, and the distribution each row was drawn from (None for greedy rows)."""
    logits = processed_logits(logits, batch)
    tokens = greedy_argmax(logits)
    dists: list[Tensor | None] = [None] * len(batch.rows)
    if batch.all_greedy:
        return tokens, dists
    rows = (batch.temperature > 0).nonzero()[:, 0]
    probs = sampling_probs(logits, batch, rows)
    tokens[rows] = exponential_race(probs, [batch.rows[i].generator for i in rows.tolist()])
    for j, i in enumerate(rows.tolist()):
        dists[i] = probs[j]
    return tokens, dists
