"""KTO (`lathe dpo --loss kto`; Ethayarajh et al. 2024, TRL's KTOTrainer): preference
learning from unpaired labels — each completion marked desirable or not, the thumbs up or
down most production feedback is — against a frozen reference, as the DPO stage runs it.

A desirable completion's loss is 1 − σ(β·(r − z)), an undesirable one's 1 − σ(β·(z − r)),
weighted by `desirable_weight` / `undesirable_weight`, where r = log π(y|x) − log π_ref(y|x)
summed over the completion and z the reference point: the policy's KL from the reference,
estimated on mismatched pairs — each prompt with another example's completion — as the mean
of their log-ratios over the micro-batch and the ranks, clamped at 0 and not
differentiated. TRL pairs each prompt with the previous completion of its micro-batch; here
with the previous one of the dataset, so that the reference's log-probs of every pair are
computed once before training, as the DPO stage caches them (either pairing is a mismatch,
which is all the estimate needs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder
from lathe.data.formats import UnpairedRow
from lathe.model.config import ModelConfig
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.common import (
    PromptFit,
    labelled_logprobs,
    pad,
    prompt_and_reply,
    sequence_work,
    token_logprobs,
    with_routing,
)
from lathe.pretrain.runtime.trainer import Work


@dataclass
class Example:
    side: tuple[list[int], list[int]]  # ids, labels (-100 on the prompt)
    mismatched: tuple[list[int], list[int]]  # the prompt with another example's completion
    desirable: bool
    reference: tuple[float, float] | None = None  # reference log-probs of both


def tokenize_unpaired(encoder: ChatEncoder, rows: list[UnpairedRow], max_len: int,
                      fit: PromptFit) -> list[Example]:
    """Each row split where its rendered prompt ends, fitted as DPO's pairs are, and paired
    with the previous kept row's completion (the first with the last's)."""
    kept = []
    for row in rows:
        prompt, completion = encoder.continuation(row.prompt, row.completion, row.tools,
                                                  row.where)
        prompt = fit(prompt)
        if prompt is not None:
            kept.append((prompt, completion, row.label))
    if len(kept) == 1:
        raise ConfigError("KTO needs at least two examples: its reference point pairs each "
                          "prompt with another example's completion")
    return [Example(prompt_and_reply(prompt, completion, max_len),
                    prompt_and_reply(prompt, kept[i - 1][1], max_len), desirable)
            for i, (prompt, completion, desirable) in enumerate(kept)]


def collate_examples(examples: list[Example], pad_token: int, device: torch.device,
                     with_reference: bool = True) -> dict[str, Any]:
    batch = {"ids": pad([e.side[0] for e in examples], pad_token).to(device),
             "labels": pad([e.side[1] for e in examples], IGNORE_INDEX).to(device),
             "mismatched_ids": pad([e.mismatched[0] for e in examples], pad_token).to(device),
             "mismatched_labels": pad([e.mismatched[1] for e in examples],
                                      IGNORE_INDEX).to(device),
             "lengths": [len(e.side[0]) for e in examples],
             "desirable": torch.tensor([e.desirable for e in examples], device=device)}
    if with_reference:
        missing = sum(e.reference is None for e in examples)
        if missing:
            raise RuntimeError(f"{missing} of {len(examples)} examples have no reference "
                               "log-probs: attach_kto_reference must see every one drawn")
        batch["reference"] = torch.tensor([e.reference for e in examples], device=device)
    return batch


@torch.no_grad()
def attach_kto_reference(model: nn.Module, examples: list[Example], micro_batch: int,
                         pad_token: int, device: torch.device) -> None:
    """Cache the reference's log-probs of each example's completion and mismatched pair
    (every rank runs every batch: a sharded reference's forward is collective)."""
    was_training = model.training
    model.eval()
    for start in range(0, len(examples), micro_batch):
        chunk = examples[start:start + micro_batch]
        batch = collate_examples(chunk, pad_token, device, with_reference=False)
        own = token_logprobs(model, batch["ids"], batch["labels"])[0].tolist()
        other = token_logprobs(model, batch["mismatched_ids"],
                               batch["mismatched_labels"])[0].tolist()
        for example, *reference in zip(chunk, own, other, strict=True):
            example.reference = tuple(reference)
    model.train(was_training)


def kto_loss(policy: Tensor, reference: Tensor, policy_mismatched: Tensor,
             reference_mismatched: Tensor, desirable: Tensor, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             mean_over_ranks: Callable[[Tensor], Tensor] = lambda t: t,
             ) -> tuple[Tensor, dict[str, Tensor]]:
    """KTO's loss on (B,) summed completion log-probs of the policy and the reference, their
    mismatched pairs' and the (B,) desirable flags; `mean_over_ranks` averages the KL
    estimate over the launch (TRL gathers it)."""
    kl = mean_over_ranks((policy_mismatched - reference_mismatched).mean().detach())
    kl = kl.clamp(min=0)
    ratio = policy - reference
    losses = torch.where(desirable, desirable_weight * (1 - F.sigmoid(beta * (ratio - kl))),
                         undesirable_weight * (1 - F.sigmoid(beta * (kl - ratio))))
    loss = losses.mean()
    rewards = beta * ratio.detach()
    chosen, rejected = desirable.float(), (~desirable).float()
    return loss, {
        "loss": loss, "kl": kl,
        "rewards/chosen": (rewards * chosen).sum() / chosen.sum().clamp(min=1),
        "rewards/rejected": (rewards * rejected).sum() / rejected.sum().clamp(min=1),
        # a completion's implicit reward on the side of 0 its label says
        "rewards/accuracy": ((rewards > 0) == desirable).float().mean()}


def kto_objective(model: nn.Module, batch: dict[str, Tensor], beta: float,
                  desirable_weight: float, undesirable_weight: float,
                  mean_over_ranks: Callable[[Tensor], Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's KTO loss: the mismatched pairs scored without gradient first, as
    TRL does, then the completions."""
    with torch.no_grad():
        mismatched = token_logprobs(model, batch["mismatched_ids"],
                                    batch["mismatched_labels"])[0]
    per_token, router = labelled_logprobs(model, batch)
    reference = batch["reference"]
    loss, metrics = kto_loss(per_token.sum(-1), reference[:, 0], mismatched, reference[:, 1],
                             batch["desirable"], beta, desirable_weight, undesirable_weight,
                             mean_over_ranks)
    return with_routing(loss, metrics, router)


def kto_work(model_config: ModelConfig, batch: dict[str, Any]) -> Work:
    """A micro-batch's completions, forward and backward, plus the mismatched pairs'
    forward (about a third of that again); its loss is a mean over examples."""
    work = sequence_work(model_config, batch["lengths"], len(batch["lengths"]))
    return dataclasses.replace(work, flops=work.flops * 4 / 3)
