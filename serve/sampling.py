"""Per-request sampling: the parameters (OpenAI names and vLLM extras) and the logits
transforms applied to one row of logits before a token is drawn.

Order, as in vLLM and HF: penalties on the raw logits (repetition divides positive logits
and multiplies negative ones for every token seen in prompt or output; presence and
frequency subtract per output token), then temperature, then top-k, top-p and min-p masks
(-inf), then a draw from the request's own seeded generator — or the argmax when the
temperature is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


class SamplingError(ValueError):
    """A sampling parameter outside its allowed range (the message names field and range)."""


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

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("temperature", 0 <= self.temperature <= 2, "in [0, 2]"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1, 0 (disabled) or a positive integer"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 2, "in (0, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("n", 1 <= self.n <= 16, "in [1, 16]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "in [0, 20]"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise SamplingError(f"{name}={getattr(self, name)!r} must be {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_penalties(logits: Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> Tensor:
    """Repetition (prompt + output), presence and frequency (output only) penalties."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device),
                                minlength=logits.shape[-1]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def mask_logits(logits: Tensor, top_k: int, top_p: float, min_p: float) -> Tensor:
    """Set to -inf every token outside top-k, outside the smallest set whose probability
    reaches top_p (the most likely token always stays), or below min_p × the top probability."""
    logits = logits.clone()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before it
        logits[order[drop]] = float("-inf")
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits[probs < min_p * probs.max()] = float("-inf")
    return logits


def sample_token(logits: Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                 output_ids: Sequence[int], generator: torch.Generator | None) -> int:
    """One token id from a (vocab,) row of logits under `params`."""
    logits = apply_penalties(logits.float(), params, prompt_ids, output_ids)
    if params.greedy:
        return int(logits.argmax())
    logits = mask_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
