"""Evaluation during training: validation loss and bits per byte on fixed val batches, and
a few sampled continuations.

Every rank evaluates its own slice of the same val windows and the sums are all-reduced,
so the figures do not depend on the world size. Bits per byte divide the summed loss (in
bits) by the UTF-8 bytes the predicted tokens stand for, which makes runs with different
tokenizers comparable; special tokens (0 bytes) are left out of both sums, as in nanochat.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from lathe.data.chat import BOS
from lathe.data.loader import PackedLoader, window_documents
from lathe.model.generate import generate
from lathe.model.head_ops import LabelLogprobs


@torch.no_grad()
def validation_metrics(model: nn.Module, loader: PackedLoader, batches: int,
                       byte_lengths: np.ndarray, accelerator,
                       separator: int | None = None) -> dict[str, float]:
    """`val/loss` (mean nats per token) and `val/bpb` over `batches` steps of `loader`,
    masked per document as training was when `separator` is given."""
    model.eval()
    device = accelerator.device
    lengths = torch.from_numpy(byte_lengths).to(device)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # nats, tokens, bpb-nats
    byte_total = torch.zeros((), dtype=torch.float64, device=device)
    for _ in range(min(batches, loader.steps_per_epoch)):
        batch = loader.next_batch().to(device)
        documents = None if separator is None else window_documents(batch, separator)
        nats = -model(batch, documents=documents, head_op=LabelLogprobs(batch)).head.flatten()
        targets = batch[:, 1:].flatten()
        counted = lengths[targets] > 0
        sums += torch.stack([nats.sum(), torch.tensor(float(nats.numel()), device=device),
                             nats[counted].sum()]).double()
        byte_total += lengths[targets].sum()
    totals = accelerator.reduce(torch.cat([sums, byte_total[None]]), reduction="sum")
    nats, tokens, counted_nats, n_bytes = totals.tolist()
    model.train()
    return {"val/loss": nats / tokens, "val/bpb": counted_nats / math.log(2) / n_bytes}


def sample_continuations(model: nn.Module, tokenizer: Tokenizer, prompts: list[str],
                         max_new_tokens: int, max_seq_len: int,
                         kv_dtype: torch.dtype | None = None, temperature: float = 0.0,
                         top_k: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """A continuation of each prompt as a document start: greedy, or sampled at
    `temperature` from the `top_k` most likely tokens with a generator seeded the same at
    every evaluation (and on every rank, which run it in lockstep, as sharded models need
    for their all-gathers)."""
    model.eval()
    rows = []
    device = next(model.parameters()).device
    bos = tokenizer.token_to_id(BOS)
    generator = torch.Generator(device).manual_seed(seed)
    for prompt in prompts:
        ids = ([bos] + tokenizer.encode(prompt).ids)[-(max_seq_len - max_new_tokens):]
        with torch.compiler.set_stance("force_eager"):
            new = generate(model, torch.tensor([ids], device=device), max_new_tokens,
                           temperature=temperature, top_k=top_k or None, generator=generator,
                           kv_dtype=kv_dtype)
        rows.append((prompt, tokenizer.decode(new[0].tolist())))
    model.train()
    return rows
