"""Log-probabilities as a request asks for them: of the sampled token and the top-N at
each position, from the model's distribution or from softmax(logits / temperature)
(`logprobs_at_temperature`, what GRPO's importance ratios need), computed in fp32."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lathe.serve.outputs import TokenLogprob
from lathe.serve.sampling_params import SamplingParams


def token_logprobs(logits: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each row's log-probability of its token and its `top` most likely tokens (fp32)."""
    rows = torch.log_softmax(logits.float(), dim=-1)
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])
    ranks = ((rows > chosen).sum(dim=1) + 1).tolist()
    best = rows.topk(top) if top else None
    return [TokenLogprob(token, value, [] if best is None else list(zip(
        best.indices[i].tolist(), best.values[i].tolist(), strict=True)), rank)
        for i, (token, value, rank) in enumerate(zip(tokens, chosen[:, 0].tolist(), ranks,
                                                     strict=True))]


def sampled_logprobs(logits: Tensor, tokens: list[int],
                     params: Sequence[SamplingParams]) -> list[TokenLogprob]:
    """Log-probs of sampled tokens and each row's top-N, of the model's distribution or of
    softmax(logits / temperature) for rows that ask for it."""
    rows = logits.float()
    divisors = [p.temperature if p.logprobs_at_temperature and p.temperature > 0 else 1.0
                for p in params]
    if any(d != 1.0 for d in divisors):
        rows = rows / torch.tensor(divisors, device=rows.device)[:, None]
    tops = [p.logprobs or 0 for p in params]
    computed = token_logprobs(rows, tokens, max(tops))
    for top, logprob in zip(tops, computed, strict=True):
        logprob.top = logprob.top[:top]
    return computed


def requested_logprobs(params: Sequence[SamplingParams], logits: Tensor,
                       tokens: list[int]) -> list[TokenLogprob | None]:
    """Per row, the log-probs of its sampled token when its request asked for them (one
    pass over those rows), else None."""
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        computed = sampled_logprobs(logits[wanted], [tokens[i] for i in wanted],
                                    [params[i] for i in wanted])
        for i, logprob in zip(wanted, computed, strict=True):
            logprobs[i] = logprob
    return logprobs
