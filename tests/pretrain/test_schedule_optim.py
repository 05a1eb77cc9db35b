"""LR schedules, optimizer parameter groups, and run-length validation."""

from __future__ import annotations

import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.pretrain.runtime.config import OptimConfig, ScheduleConfig, TrainConfig
from lathe.pretrain.runtime.optim import build_optimizers, param_groups
from lathe.pretrain.runtime.schedule import lr_factor
from tests.builders import tiny_model


def test_cosine_warms_up_then_decays_to_the_floor():
    config = ScheduleConfig(kind="cosine", warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(s, 20, config) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:], strict=False))
    assert factors[12] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(
        torch.pi * 8 / 15)).item()))


def test_wsd_is_flat_then_decays_linearly_over_the_last_fraction():
    config = ScheduleConfig(kind="wsd", warmup_steps=2, min_lr_ratio=0.0, decay_fraction=0.25)
    factors = [lr_factor(s, 20, config) for s in range(20)]
    assert factors[:2] == [0.5, 1.0] and set(factors[2:15]) == {1.0}
    assert factors[15:] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0])
    assert lr_factor(5, 20, ScheduleConfig(kind="constant", warmup_steps=0)) == 1.0


def test_a_cooldown_falls_linearly_from_where_it_begins_to_the_floor():
    """Begun at step 8 of a 20-step cosine, the factor leaves the cosine there and falls
    linearly to min_lr_ratio at the cooldown's last step; before it, the schedule is
    unchanged."""
    config = ScheduleConfig(kind="cosine", warmup_steps=2, min_lr_ratio=0.1)
    begin = lr_factor(8, 20, config)
    factors = [lr_factor(s, 20, config, cooldown=(8, 12)) for s in range(12)]
    assert factors[:8] == [lr_factor(s, 20, config) for s in range(8)]
    assert factors[8:] == pytest.approx([begin - (begin - 0.1) * k / 4 for k in (1, 2, 3, 4)])
    assert factors[-1] == pytest.approx(0.1) and 0.1 < begin < 1


def test_weight_decay_only_on_matrices():
    model = tiny_model()
    decay, no_decay = param_groups(model, 0.1)
    assert all(p.ndim == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == model.config.num_params()  # the tied matrix counted once


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = tiny_model(tie_embeddings=False)
    muon, adamw = build_optimizers(model, OptimConfig(name="muon"), "cpu")
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = [names[id(p)] for g in muon.param_groups for p in g["params"]]
    adamw_names = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert len(muon_names) == 7 * model.config.n_layers
    assert all(".layers." in n and n.endswith("proj.weight") for n in muon_names)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adamw_names


def test_run_length_is_exactly_one_of_steps_tokens_or_ratio():
    assert TrainConfig(max_steps=7).total_steps(100, 10**6) == 7
    assert TrainConfig(max_steps=None, max_tokens=1050).total_steps(100, 1) == 11
    assert TrainConfig(max_steps=None, tokens_per_param=20).total_steps(1000, 500) == 10
    with pytest.raises(ConfigError, match="exactly one of max_steps, max_tokens"):
        TrainConfig(max_steps=5, max_tokens=100)
    with pytest.raises(ConfigError, match="schedule.min_lr_ratio"):
        TrainConfig(schedule=ScheduleConfig(min_lr_ratio=2.0))
