"""Aux-loss-free balancing's update: each over-loaded expert's selection bias falls by the
speed, each under-loaded one's rises, an expert at its layer's mean keeps its own; the counts
are those of every micro-batch of the step, summed over ranks."""

from __future__ import annotations

import pytest
import torch

from lathe.model import ModelConfig, Transformer
from lathe.model.transformer import RouterStats
from lathe.pretrain.expert_balance import ExpertBiasBalancer, selection_biases


def glm4_moe() -> Transformer:
    config = ModelConfig.from_preset("tiny", family="glm4_moe", n_layers=3, n_experts=4,
                                     moe_layers=[0, 1, 1], vocab_size=64)
    return Transformer(config)


def stats(loads: list[list[float]]) -> RouterStats:
    return RouterStats(None, torch.tensor(0.0), torch.tensor(loads))


def test_biases_move_against_the_load_by_the_speed():
    model = glm4_moe()
    balancer = ExpertBiasBalancer(0.01)
    balancer.observe(stats([[6, 2, 4, 4], [0, 8, 4, 4]]))  # two micro-batches of a step
    balancer.observe(stats([[6, 2, 4, 4], [4, 4, 4, 4]]))
    balancer.update(model, lambda counts: counts)
    first, second = selection_biases(model)
    torch.testing.assert_close(first, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    torch.testing.assert_close(second, torch.tensor([0.01, -0.01, 0.0, 0.0]))
    assert first.dtype == torch.float32
    # the next step starts counting afresh, and the summed counts of every rank decide
    balancer.observe(stats([[1, 1, 1, 5], [4, 4, 4, 4]]))
    balancer.update(model, lambda counts: counts + torch.tensor([[9, 0, 0, 0], [0, 0, 0, 0]]))
    torch.testing.assert_close(first, torch.tensor([-0.02, 0.02, 0.01, -0.01]))


def test_an_update_without_counts_or_with_other_layers_is_an_error():
    model = glm4_moe()
    balancer = ExpertBiasBalancer(0.01)
    with pytest.raises(RuntimeError, match="before any observed forward"):
        balancer.update(model, lambda counts: counts)
    balancer.observe(stats([[1, 2, 3, 4]]))
    with pytest.raises(RuntimeError, match="2 selection biases for 1 counted MoE layers"):
        balancer.update(model, lambda counts: counts)
