"""Post-training losses against hand computations and closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.model import ModelConfig, Transformer
from lathe.posttrain.config import DPOConfig
from lathe.posttrain.dpo import dpo_loss, rpo_loss
from lathe.posttrain.grpo import clipped_surrogate, group_advantages
from lathe.posttrain.rewards import exact_number, length_penalty, load_reward


def test_dpo_sigmoid_loss_matches_the_closed_form_and_is_log2_at_the_reference():
    policy = torch.tensor([-3.0, -5.0, -4.0, -4.5])  # chosen (2) then rejected (2)
    reference = torch.tensor([-3.5, -4.0, -4.0, -4.0])
    loss, metrics = dpo_loss(policy, reference, beta=0.1)
    margins = torch.tensor([(-3.0 + 3.5) - (-4.0 + 4.0), (-5.0 + 4.0) - (-4.5 + 4.0)])
    expected = -torch.nn.functional.logsigmoid(0.1 * margins).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.1 * (0.5 - 1.0) / 2)
    assert metrics["rewards/accuracy"].item() == 0.5
    same, _ = dpo_loss(reference, reference, beta=0.1)
    assert same.item() == pytest.approx(math.log(2), rel=1e-6)
    ipo, _ = dpo_loss(reference, reference, beta=0.1, kind="ipo")
    assert ipo.item() == pytest.approx((1 / 0.2) ** 2)


def test_rpo_adds_the_chosen_replies_per_token_nll_to_dpo():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", vocab_size=64, n_layers=1))
    ids = torch.randint(0, 64, (4, 7))  # 2 chosen rows, then 2 rejected
    labels = ids.clone()
    labels[:, :3] = -100
    labels[0, 6] = -100  # chosen replies of 3 and 4 labelled tokens
    batch = {"ids": ids, "labels": labels, "reference": torch.zeros(4)}
    plain, _ = rpo_loss(model, batch, False, 0.1, "sigmoid", 0.0)
    mixed, metrics = rpo_loss(model, batch, False, 0.1, "sigmoid", 0.5)
    logits = model(ids).logits[:2, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels[:2, 1:].reshape(-1),
                                            ignore_index=-100)  # the mean over all 7 tokens
    assert metrics["nll_loss"].item() == pytest.approx(nll.item(), rel=1e-5)
    assert mixed.item() == pytest.approx(plain.item() + 0.5 * nll.item(), rel=1e-5)
    with pytest.raises(ConfigError, match="rpo_alpha=-1"):
        DPOConfig(rpo_alpha=-1)


def test_group_advantages_standard_and_dr_grpo():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards)
    std = math.sqrt((4 * 0.25) / 3)  # the sample (Bessel) std, as torch.std and TRL
    assert adv[0].tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4),
                                             -0.5 / (std + 1e-4), 0.5 / (std + 1e-4)])
    assert adv[1].tolist() == [0.0] * 4  # a group that all agrees teaches nothing
    assert group_advantages(rewards, scale=False)[0].tolist() == [0.5, -0.5, -0.5, 0.5]


def test_clipped_surrogate_matches_a_hand_computation():
    old = torch.zeros(2, 3)
    logps = torch.log(torch.tensor([[1.5, 0.9, 1.0], [0.5, 1.1, 1.0]]))
    mask = torch.tensor([[True, True, False], [True, True, True]])
    advantages = torch.tensor([1.0, -2.0])
    loss, metrics = clipped_surrogate(logps, old, advantages, mask, epsilon=0.2)
    # row 0 (A=+1): min(1.5, 1.2) = 1.2; min(0.9, 0.9) = 0.9
    # row 1 (A=-2): min(-1.0, -1.6) = -1.6; min(-2.2, -2.2) = -2.2; min(-2, -2) = -2
    expected = -(1.2 + 0.9 - 1.6 - 2.2 - 2.0) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 5)  # 1.5 up, 0.5 down
    higher, _ = clipped_surrogate(logps, old, advantages, mask, 0.2, epsilon_high=0.28)
    assert higher.item() == pytest.approx(-(1.28 + 0.9 - 1.6 - 2.2 - 2.0) / 5, rel=1e-6)
    ref = torch.log(torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]))
    with_kl, m = clipped_surrogate(logps, old, advantages, mask, 0.2, None, ref, beta=0.5)
    delta = ref - logps
    kl = ((torch.exp(delta) - delta - 1) * mask).sum() / 5
    assert m["kl"].item() == pytest.approx(kl.item(), rel=1e-6)
    assert with_kl.item() == pytest.approx(expected + 0.5 * kl.item(), rel=1e-5)


def test_dr_grpo_divides_by_a_constant_not_the_token_count():
    """Dr. GRPO (Liu et al. 2025): the token sum over a fixed normalizer (completions ×
    max_completion_tokens), so a long completion's tokens weigh what a short one's do."""
    old = torch.zeros(2, 4)
    logps = torch.zeros(2, 4)  # ratio 1: the surrogate is −A per token
    mask = torch.tensor([[True, False, False, False], [True, True, True, True]])
    advantages = torch.tensor([1.0, 1.0])
    dapo, _ = clipped_surrogate(logps, old, advantages, mask, 0.2)
    dr, _ = clipped_surrogate(logps, old, advantages, mask, 0.2, normalizer=2 * 8)
    assert dapo.item() == pytest.approx(-5 / 5)
    assert dr.item() == pytest.approx(-5 / 16)

def test_reward_registry_and_user_functions():
    assert exact_number("so it is 42", "42") == 1.0 and exact_number("41", "42") == 0.0
    assert length_penalty("x" * 150, "x" * 50) == pytest.approx(-1.0)
    digit_match = load_reward("digit_match")
    assert digit_match("1209", "1209") == 1.0
    assert digit_match("so 1219", "1209") == 0.75  # the tens digit is wrong
    assert digit_match("209", "1209") == 0.75  # a dropped leading digit: 3 of 4 places
    assert digit_match("11209", "1209") == 0.8  # an extra digit costs a place too
    assert digit_match("-17", "17") == digit_match("no number", "17") == 0.0
    assert digit_match("-18", "-17") == 0.5
    assert load_reward("tests.posttrain.test_losses:my_reward")("ab", "") == 2.0
    with pytest.raises(Exception, match="cannot be imported"):
        load_reward("tests.nope:missing")


def my_reward(completion: str, reference: str) -> float:
    return float(len(completion))
