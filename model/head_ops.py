"""Head ops the stages share: what is computed from the LM head's output for a batch, given
to the model's forward (`Transformer.forward(head_op=...)`) so that the (B, T, vocab)
logits are never held where the head's weight is whole (see `HeadOp`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lathe.kernels.fused_ce import IGNORE_INDEX, linear_token_logprobs


@dataclass
class LabelLogprobs:
    """log p(labels[:, t + 1] | tokens ≤ t) for each position t of a (B, T) batch, from
    logits / `temperature`, as (B, T − 1) fp32; 0 where the label is -100 (`labels` align
    with the input ids, as the model's own labels do)."""

    labels: Tensor
    temperature: float = 1.0

    def chunked(self, hidden: Tensor, weight: Tensor, softcap: float | None) -> Tensor:
        targets = self.labels[:, 1:]
        logps = linear_token_logprobs(hidden[:, :-1].flatten(0, 1), weight, targets.flatten(),
                                      temperature=self.temperature, softcap=softcap)
        return logps.view(targets.shape)

    def from_logits(self, logits: Tensor) -> Tensor:
        targets = self.labels[:, 1:]
        scaled = logits[:, :-1].float() / self.temperature
        picked = torch.log_softmax(scaled, dim=-1).gather(-1, targets.clamp(min=0)[..., None])
        return picked[..., 0] * (targets != IGNORE_INDEX)
