"""Per-request sampling: the parameters (OpenAI names and vLLM extras) and the logits
transforms applied to one row of logits before a token is drawn.

Order, as in vLLM and HF: penalties on the raw logits (repetition divides positive logits
and multiplies negative ones for every token seen in prompt or output; presence and
frequency subtract per output token), then the request's `logit_bias`, then temperature,
then top-k, top-p and min-p masks (-inf), then a draw from the request's own seeded
generator — or the argmax when the temperature is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


class SamplingError(ValueError):
    """A sampling parameter outside its allowed range (the message names field and range)."""


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP, MAX_STOP_CHARS = 16, 256  # stop matching runs per generated token


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

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("seed", self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
             "a 64-bit signed integer"),
            ("temperature", 0 <= self.temperature <= 2, "in [0, 2]"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1, 0 (disabled) or a positive integer"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", 0 < self.repetition_penalty <= 2, "in (0, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("n", 1 <= self.n <= 16, "in [1, 16]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "in [0, 20]"),
            ("logit_bias", all(-100 <= v <= 100 for v in self.logit_bias.values()),
             "a map of token id to a bias in [-100, 100]"),
            ("stop", len(self.stop) <= MAX_STOP and all(
                len(text) <= MAX_STOP_CHARS for text in self.stop),
             f"at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                value = repr(getattr(self, name))
                value = value if len(value) <= 80 else value[:77] + "..."
                raise SamplingError(f"{name}={value} must be {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: the argmax of the whole batch can stand in for it."""
        return (self.greedy and self.repetition_penalty == 1.0 and not self.presence_penalty
                and not self.frequency_penalty and not self.logit_bias)

    def generator(self, device: torch.device | str, index: int) -> torch.Generator | None:
        """The seeded generator of the request's `index`-th sequence (None without a seed)."""
        if self.seed is None:
            return None
        return torch.Generator(device).manual_seed((self.seed + index) % 2**64)


def apply_penalties(logits: Tensor, params: SamplingParams, prompt_ids: Sequence[int],
                    output_ids: Sequence[int]) -> Tensor:
    """Repetition (prompt + output), presence and frequency (output only) penalties, then
    the logit bias."""
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
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device,
                                    dtype=logits.dtype)
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
