"""Sampling: the batched transforms and draw that pick one token for every row of a step at
once, under each request's `SamplingParams` (`lathe.serve.sampling_params`).

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
from dataclasses import dataclass

import torch
from torch import Tensor

from lathe.kernels.argmax import greedy_argmax
from lathe.serve.sampling_params import SamplingParams


def seeded_generator(params: SamplingParams, device: torch.device | str,
                     index: int) -> torch.Generator | None:
    """The seeded generator of a request's `index`-th sequence (None without a seed)."""
    if params.seed is None:
        return None
    return torch.Generator(device).manual_seed((params.seed + index) % 2**64)


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
    q ~ Exp(1), each row's q from its own generator when it has one. q is drawn as −log(u),
    u ~ U[0, 1): torch's `exponential_` takes 3–4× as long on a CPU, and a GRPO step draws
    over its rows × the vocabulary for every token."""
    uniform = torch.empty_like(probs)
    if all(generator is None for generator in generators):
        uniform.uniform_()
    else:
        for j, generator in enumerate(generators):
            uniform[j].uniform_(generator=generator)
    return (probs / uniform.log_().neg_()).argmax(dim=-1)


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
