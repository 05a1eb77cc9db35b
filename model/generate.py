"""Reference autoregressive generation: one batch, a contiguous KV cache, no scheduler.

This is the simple decode loop that `lathe generate` and the tests use; serving with
a paged cache and continuous batching is `lathe.serve`'s job.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lathe.model.kv_cache import ContiguousKVCache
from lathe.model.transformer import Transformer


@torch.no_grad()  # not inference_mode: torchao's FP8 linears fail under it with autocast
def generate(model: Transformer, prompt_ids: Tensor, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None,
             eos_token_id: int | None = None,
             generator: torch.Generator | None = None,
             kv_dtype: torch.dtype | None = None) -> Tensor:
    """Continue each row of `prompt_ids` (B, T); return the (B, n) new tokens.

    Greedy when `temperature` is 0, otherwise sampled from softmax(logits / temperature)
    restricted to the `top_k` most likely tokens. Stops early once every row has
    produced `eos_token_id`; a row that finished first is padded with it. The KV cache is
    in `kv_dtype`, by default the weights' dtype.
    """
    model.config.require_language_model("generate")
    batch, prompt_len = prompt_ids.shape
    weight = model.model.embed_tokens.weight
    cache = ContiguousKVCache(model.config, batch, prompt_len + max_new_tokens,
                              device=weight.device, dtype=kv_dtype or weight.dtype)
    last = torch.tensor([prompt_len - 1], device=prompt_ids.device)  # the head on 1 row
    logits = model(prompt_ids, kv_cache=cache, logits_to_keep=last).logits[:, -1]
    done = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    new_tokens = []
    for _ in range(max_new_tokens):
        token = sample(logits, temperature, top_k, generator)
        if eos_token_id is not None:
            token = token.masked_fill(done, eos_token_id)
            done |= token == eos_token_id
        new_tokens.append(token)
        if done.all():
            break
        logits = model(token[:, None], kv_cache=cache).logits[:, -1]
    return torch.stack(new_tokens, dim=1) if new_tokens else prompt_ids[:, :0]


def sample(logits: Tensor, temperature: float, top_k: int | None = None,
           generator: torch.Generator | None = None) -> Tensor:
    """One token id per row of (B, vocab) logits: argmax at temperature 0, else sampled."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
