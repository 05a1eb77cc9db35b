"""Post-training losses against hand computations and closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.model import ModelConfig, Transformer
from lathe.posttrain.config import DPOConfig, GRPOConfig
from lathe.posttrain.dpo import dpo_loss, orpo_loss, rpo_loss, simpo_loss
from lathe.posttrain.grpo import (
    clipped_surrogate,
    group_advantages,
    informative,
    overlong_penalty,
    sampling_weights,
    select_groups,
)
from lathe.posttrain.kto import kto_loss
from lathe.posttrain.rewards import exact_number, length_penalty, load_reward
from lathe.posttrain.rollouts import Rollout, collate


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
    batch = {"ids": ids, "labels": labels, "lengths": [7] * 4, "reference": torch.zeros(4)}
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


def trl_method(path: str, name: str, **settings):
    """TRL 1.16's loss method `name` of the trainer at `path`, on a stand-in `self` that
    holds only the settings it reads."""
    import importlib
    from types import SimpleNamespace

    module, cls = path.rsplit(".", 1)
    method = getattr(getattr(importlib.import_module(module), cls), name)
    owner = SimpleNamespace(accelerator=SimpleNamespace(device="cpu"), alpha=0.0,
                            label_smoothing=0.0, **settings)
    return lambda *args: method(owner, *args)


LOGPS = torch.tensor([-0.4, -1.3, -0.05, -2.0, -0.9, -0.7])  # mean token log-probs: 3 + 3


def test_simpo_equals_trls_cpo_simpo_loss():
    cpo = trl_method("trl.experimental.cpo.cpo_trainer.CPOTrainer", "cpo_loss",
                     loss_type="simpo", beta=2.0, simpo_gamma=0.8)
    losses, chosen, rejected = cpo(*LOGPS.chunk(2))
    loss, metrics = simpo_loss(LOGPS, beta=2.0, gamma=0.8)
    assert loss.item() == pytest.approx(losses.mean().item(), rel=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(chosen.mean().item(), rel=1e-6)
    assert metrics["rewards/margins"].item() == pytest.approx((chosen - rejected).mean().item())


def test_orpo_equals_trls_odds_ratio_loss():
    orpo = trl_method("trl.experimental.orpo.orpo_trainer.ORPOTrainer", "odds_ratio_loss",
                      beta=0.1)
    losses, chosen, rejected, ratio, log_odds = orpo(*LOGPS.chunk(2))
    nll = torch.tensor(1.7)
    loss, metrics = orpo_loss(LOGPS, nll, beta=0.1)
    assert loss.item() == pytest.approx((nll - losses.mean()).item(), rel=1e-6)  # TRL's total
    assert metrics["log_odds_ratio"].item() == pytest.approx(ratio.item(), rel=1e-6)
    assert metrics["log_odds_chosen"].item() == pytest.approx(log_odds.item(), rel=1e-6)
    far, _ = orpo_loss(torch.tensor([-1e-7, -30.0, -40.0, -1e-7]), nll, beta=0.1)
    assert torch.isfinite(far)  # log(1 − p) stays finite at p → 1 and p → 0


def test_orpo_scores_whole_chosen_rows_and_mean_reply_log_probs():
    """ORPO's NLL is over each chosen row's every token after the first, prompt included
    (TRL's, for decoder-only models); its odds use each reply's mean token log-prob."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", vocab_size=64, n_layers=1))
    ids = torch.randint(0, 64, (4, 7))
    labels = ids.clone()
    labels[:, :3] = -100
    labels[2, 5:] = -100  # a shorter rejected reply, padded
    lengths = [7, 7, 5, 7]
    batch = {"ids": ids, "labels": labels, "lengths": lengths}
    loss, metrics = rpo_loss(model, batch, True, 0.1, "orpo", 0.0)
    logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1).gather(
        -1, ids[:, 1:, None])[..., 0]
    nll = -logp[:2].mean()  # both chosen rows are whole: 6 scored tokens each
    assert metrics["nll_loss"].item() == pytest.approx(nll.item(), rel=1e-5)
    replies = labels[:, 1:] != -100
    mean = (logp * replies).sum(-1) / replies.sum(-1)
    expected, _ = orpo_loss(mean, nll, 0.1)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_reference_free_losses_refuse_what_they_cannot_use():
    with pytest.raises(ConfigError, match="ORPO already trains"):
        DPOConfig(loss="orpo", rpo_alpha=1.0)
    with pytest.raises(ConfigError, match="uses no reference model"):
        DPOConfig(loss="simpo", reference="runs/ref")
    with pytest.raises(ConfigError, match="simpo_gamma=-1"):
        DPOConfig(loss="simpo", simpo_gamma=-1)


def test_kto_loss_matches_the_hand_computation():
    """TRL's KTO step on fixed log-probs: the reference point is the mismatched pairs' mean
    log-ratio, clamped at 0 and not differentiated; each side's loss 1 − σ(β·(±(r − z)))."""
    policy = torch.tensor([-3.0, -5.0, -4.0, -2.0], requires_grad=True)
    reference = torch.tensor([-3.5, -4.0, -4.0, -2.5])
    mismatched = torch.tensor([-9.0, -8.0, -7.5, -9.0], requires_grad=True)
    reference_mismatched = torch.tensor([-9.2, -8.4, -7.5, -9.1])
    desirable = torch.tensor([True, False, True, False])
    loss, metrics = kto_loss(policy, reference, mismatched, reference_mismatched, desirable,
                             beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)
    z = (0.2 + 0.4 + 0.0 + 0.1) / 4
    r = [0.5, -1.0, 0.0, 0.5]

    def side(x: float) -> float:
        return 1 - 1 / (1 + math.exp(-0.5 * x))

    expected = (side(r[0] - z) + 1.5 * side(z - r[1]) + side(r[2] - z)
                + 1.5 * side(z - r[3])) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["kl"].item() == pytest.approx(z, rel=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.5 * (0.5 + 0.0) / 2)
    # rewards 0.25, -0.5, 0, 0.25: the first two on their labels' side of 0
    assert metrics["rewards/accuracy"].item() == 0.5
    loss.backward()
    assert mismatched.grad is None  # the reference point carries no gradient
    below, below_metrics = kto_loss(policy, reference, reference_mismatched - 1,
                                    reference_mismatched, desirable, beta=0.5)
    assert below_metrics["kl"].item() == 0.0  # a negative estimate is clamped


def test_kto_settings_are_checked():
    with pytest.raises(ConfigError, match="undesirable_weight=0"):
        DPOConfig(loss="kto", undesirable_weight=0)
    with pytest.raises(ConfigError, match="no chosen NLL"):
        DPOConfig(loss="kto", rpo_alpha=1.0)


def trl_grpo_loss(logps, old, advantages, mask, eps_low, eps_high, ref, beta, level,
                  bias_correction):
    """TRL 1.16's GRPOTrainer._compute_loss for loss_type "dapo" (the mean over every
    completion token), its lines in order."""
    log_ratio = logps - old
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
    if bias_correction:
        per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * advantages[:, None], coef_2 * advantages[:, None])
    per_token_loss = per_token_loss + beta * per_token_kl
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("correction", [False, True])
def test_grpo_loss_equals_trls_with_gspo_and_the_kl_correction(level, correction):
    torch.manual_seed(0)
    old = -torch.rand(3, 5) * 3
    logps = (old + 0.3 * torch.randn(3, 5)).requires_grad_()
    ref = old + 0.2 * torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]).float()
    advantages = torch.tensor([1.2, -0.7, 0.4])
    eps = (3e-4, 4e-4) if level == "sequence" else (0.2, 0.28)
    loss, _ = clipped_surrogate(logps, old, advantages, mask, *eps, ref, 0.04, None,
                                level == "sequence", correction)
    expected = trl_grpo_loss(logps, old, advantages, mask, *eps, ref, 0.04, level, correction)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    ours = torch.autograd.grad(loss, logps)[0]
    theirs = torch.autograd.grad(trl_grpo_loss(logps, old, advantages, mask, *eps, ref, 0.04,
                                               level, correction), logps)[0]
    torch.testing.assert_close(ours, theirs)


def trl_sampling_ratio(old, sampled, mask, mode, low, high):
    """TRL 1.16's vLLM importance-sampling weights (GRPOTrainer, its lines in order)."""
    diff = (old - sampled) * mask
    diff = torch.nan_to_num(diff, nan=0.0)
    diff = diff.sum(dim=-1, keepdim=True) if mode in ["sequence_mask", "sequence_truncate"] \
        else diff
    ratio = torch.exp(diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=low, max=high)
    min_val = low if low is not None else 0.0
    max_val = high if high is not None else float("inf")
    return ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate",
                                  "sequence_mask"])
def test_sampling_gap_weights_equal_trls(mode):
    torch.manual_seed(1)
    old = -torch.rand(4, 6) * 2
    sampled = old + 0.6 * torch.randn(4, 6)  # a gap large enough to cross the bounds
    mask = (torch.rand(4, 6) > 0.2).float()
    for low, high in ((None, 3.0), (0.5, 2.0)):
        ours = sampling_weights(old, sampled, mask.bool(), mode, low, high)
        torch.testing.assert_close(ours, trl_sampling_ratio(old, sampled, mask, mode, low, high))
    weight = sampling_weights(old, sampled, mask.bool(), mode, None, 3.0)
    logps = old.clone().requires_grad_()
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])
    loss, _ = clipped_surrogate(logps, old, advantages, mask, 0.2, None, sampling_weight=weight)
    plain, _ = clipped_surrogate(logps, old, advantages, mask, 0.2)
    # at ratio 1 the surrogate per token is −A: weighted, −A·w
    expected = -(advantages[:, None] * weight * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert plain.item() != pytest.approx(loss.item())
    with pytest.raises(ConfigError, match="sampling_correction_min=2"):
        GRPOConfig(sampling_correction="token_mask", sampling_correction_min=2,
                   sampling_correction_max=1)


def test_soft_overlong_penalty_equals_trls():
    from trl.rewards import get_soft_overlong_punishment
    for max_length, buffer in ((10, 3), (12, 2), (8, 8), (5, 1)):
        lengths = list(range(max_length + 3))
        theirs = get_soft_overlong_punishment(max_length, buffer)([[7] * n for n in lengths])
        assert [overlong_penalty(n, max_length, buffer) for n in lengths] == pytest.approx(theirs)
    assert GRPOConfig(max_completion_tokens=12).overlong_buffer == 2  # a fifth, by default
    with pytest.raises(ConfigError, match="overlong_buffer=13 must be between 1 and "
                                          "max_completion_tokens=12"):
        GRPOConfig(max_completion_tokens=12, overlong_buffer=13)


def rollout(reward: float, completion: list[int], truncated: bool = False,
            masked: bool = False) -> Rollout:
    return Rollout([1, 2], completion, reward, 0.0, [-1.0] * len(completion),
                   [True] * len(completion), truncated, masked)


def test_overlong_filter_leaves_truncated_completions_out_of_the_loss_as_trl():
    """TRL's mask_truncated_completions: the truncated rows' completion mask is zeroed, and
    the step's token count (the loss's divisor) counts only the rows left."""
    rows = [rollout(1.0, [5, 6, 7], truncated=True, masked=True), rollout(0.0, [5, 6]),
            rollout(0.5, [8, 9, 9], truncated=True, masked=True), rollout(1.0, [4])]
    batch = collate(rows, 0, torch.device("cpu"))
    kept = batch["mask"].any(-1).tolist()
    assert kept == [False, True, False, True]
    torch.manual_seed(0)
    old = -torch.rand(batch["mask"].shape)
    logps = old + 0.1 * torch.randn(old.shape)
    advantages = torch.tensor([0.5, -1.0, 0.3, 0.8])
    loss, _ = clipped_surrogate(logps, old, advantages, batch["mask"], 0.2)
    unmasked = collate([rollout(r.reward, r.completion_ids) for r in rows], 0,
                       torch.device("cpu"))["mask"]
    is_truncated = torch.tensor([r.truncated for r in rows])
    trl_mask = unmasked * (~is_truncated).unsqueeze(1).int()
    ratio = torch.exp(logps - old)
    per_token = -torch.min(ratio * advantages[:, None],
                           torch.clamp(ratio, 0.8, 1.2) * advantages[:, None])
    expected = (per_token * trl_mask).sum() / trl_mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_dynamic_sampling_keeps_groups_whose_rewards_differ_in_draw_order():
    flat, mixed, ones = ([rollout(r, [3]) for r in rewards]
                         for rewards in ([0.0, 0.0], [0.0, 1.0], [1.0, 1.0]))
    assert not informative(flat) and informative(mixed) and not informative(ones)
    other = [rollout(0.2, [3]), rollout(0.3, [3])]
    # enough groups that differ: all-equal ones dropped, the rest cut to the first `wanted`
    assert select_groups([flat, mixed, ones, other, mixed], 2) == ([mixed, other], 0)
    # too few: topped up with the first all-equal groups, in the order they were drawn
    chosen, filled = select_groups([flat, ones, mixed, flat], 3)
    assert chosen == [flat, ones, mixed] and filled == 2


def test_rollout_settings_are_checked():
    from lathe.posttrain.config import RolloutConfig
    with pytest.raises(ConfigError, match="rollout.url='http://h:1' needs rollout.weights_dir"):
        RolloutConfig(url="http://h:1")
    with pytest.raises(ConfigError, match="rollout.max_staleness=1 samples on an engine in its "
                                          "own process"):
        RolloutConfig(max_staleness=1)
    with pytest.raises(ConfigError, match="0 \\(synchronous\\) or 1"):
        RolloutConfig(url="http://h:1", weights_dir="w", max_staleness=2)
    remote = RolloutConfig(url="http://h:1", weights_dir="w", max_staleness=1)
    with pytest.raises(ConfigError, match="correct for it with sampling_correction"):
        GRPOConfig(rollout=remote)
    with pytest.raises(ConfigError, match="a server's log-probs are of the distribution before "
                                          "temperature"):
        GRPOConfig(rollout=remote, sampling_correction="token_truncate", temperature=0.7)
