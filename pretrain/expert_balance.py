"""Auxiliary-loss-free load balancing of a mixture of experts (DeepSeek-V3, after Wang et
al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts").

A sigmoid router (`ModelConfig.sigmoid_router`) chooses experts by score plus a per-expert
selection bias, and weights them by the unbiased score. Instead of a balance loss, whose
gradient competes with the language-modelling one, the bias is moved after every optimizer
step: each expert of each MoE layer that took more than its layer's mean number of
token-expert assignments over the step's micro-batches (on every data-parallel rank) has
its bias lowered by `speed`, each that took fewer has it raised (b += speed · sign(mean −
load)). The counts are summed over ranks first, so every rank applies the same update and
the biases — plain buffers, not sharded by FSDP2 or ZeRO-3 — stay identical. The bias is
part of the model: it is saved in resumable state and in the exported checkpoint, where
transformers' class (GLM-4.5's `e_score_correction_bias`) reads it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from lathe.model.transformer import MoE, RouterStats


def selection_biases(model: nn.Module) -> list[Tensor]:
    """The selection bias of each MoE layer with a sigmoid router, in layer order."""
    return [module.gate.e_score_correction_bias for module in model.modules()
            if isinstance(module, MoE) and module.sigmoid]


class ExpertBiasBalancer:
    """Counts the step's expert loads (`observe`, per forward) and moves the selection
    biases once the step is over (`update`, on every rank)."""

    def __init__(self, speed: float) -> None:
        self.speed = speed
        self.counts: Tensor | None = None

    def observe(self, router: RouterStats) -> None:
        load = router.layer_load.detach().float()
        self.counts = load if self.counts is None else self.counts + load

    @torch.no_grad()
    def update(self, model: nn.Module, sum_over_ranks: Callable[[Tensor], Tensor]) -> None:
        """Move each layer's biases towards its mean load. Collective: every rank calls it
        after every step, with the step's counts."""
        if self.counts is None:
            raise RuntimeError("ExpertBiasBalancer.update before any observed forward")
        counts, self.counts = sum_over_ranks(self.counts), None
        biases = selection_biases(model)
        if len(biases) != counts.shape[0]:
            raise RuntimeError(f"{len(biases)} selection biases for {counts.shape[0]} counted "
                               "MoE layers")
        step = self.speed * torch.sign(counts.mean(dim=1, keepdim=True) - counts)
        for bias, delta in zip(biases, step, strict=True):
            bias.add_(delta.to(bias.device, bias.dtype))
