"""Distillation: KD losses against their formulas and TRL's, the shared-tokenizer check,
short runs in all three modes, a mixture-of-experts student's balance loss only when asked,
and on-policy distillation resumed after a kill."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lathe.core.cli import main
from lathe.core.errors import ConfigError
from lathe.data.formats import load_prompt_dataset
from lathe.data.mixture import WeightedSource, load_mixture
from lathe.data.tokenizer import save_tokenizer, train_tokenizer
from lathe.model import ModelConfig, Transformer, load_checkpoint, save_checkpoint
from lathe.posttrain.distill import check_same_tokenizer
from lathe.posttrain.divergence import kd_loss
from tests.posttrain.conftest import killed_and_resumed, quick

ROOT = Path(__file__).resolve().parents[2]


def test_kd_losses_match_their_formulas():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    p_t, p_s = teacher.softmax(-1), student.softmax(-1)
    forward = (p_t * (p_t.log() - p_s.log())).sum(-1)[mask].mean()
    assert kd_loss(student, teacher, mask).item() == pytest.approx(forward.item(), rel=1e-5)
    reverse = (p_s * (p_s.log() - p_t.log())).sum(-1)[mask].mean()
    assert kd_loss(student, teacher, mask, "reverse_kl").item() == pytest.approx(
        reverse.item(), rel=1e-5)
    m = 0.5 * (p_t + p_s)
    jsd = 0.5 * (F.kl_div(m.log(), p_t, reduction="none").sum(-1)
                 + F.kl_div(m.log(), p_s, reduction="none").sum(-1))[mask].mean()
    assert kd_loss(student, teacher, mask, "jsd").item() == pytest.approx(jsd.item(), rel=1e-5)
    assert kd_loss(student, teacher, mask, "jsd").item() <= math.log(2)
    assert kd_loss(teacher, teacher, mask).item() == pytest.approx(0.0, abs=1e-6)
    hot = (teacher / 2).softmax(-1)
    scaled = (hot * (hot.log() - (student / 2).log_softmax(-1))).sum(-1)[mask].mean() * 4
    assert kd_loss(student, teacher, mask, temperature=2.0).item() == pytest.approx(
        scaled.item(), rel=1e-5)


@pytest.fixture(scope="module")
def teacher(base, tmp_path_factory):
    """Another random model on the base's tokenizer, with sharper distributions."""
    config = load_checkpoint(base).config
    torch.manual_seed(1)
    model = Transformer(ModelConfig(**{**config.__dict__, "init_std": 0.1}))
    return save_checkpoint(model, tmp_path_factory.mktemp("teacher") / "t", tokenizer=base)


def test_students_kl_to_its_teacher_falls(base, teacher, tmp_path):
    out = tmp_path / "kd"
    assert main(["distill", *quick(out, base, teacher=teacher, max_steps=20, **{
        "optim.lr": 3e-3, "eval.every": 20, "ce_weight": 0.0, "loss": "forward_kl"})]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kl_to_teacher"][-1] < 0.7 * summary["kl_to_teacher"][0]
    assert {"student_accuracy", "teacher_accuracy"} <= set(summary)
    logged = [(r["step"], r["eval/kl_to_teacher"]) for r in map(
        json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval/kl_to_teacher" in r]
    assert logged == list(zip([0, 20], summary["kl_to_teacher"], strict=True))  # report's start


def test_a_mixture_of_experts_student_adds_its_balance_loss_only_when_asked(base, teacher,
                                                                           tmp_path):
    """As TRL's GKD, the divergence adds no balance loss by default, though the routing is
    logged; router_aux_loss_coef adds that weight times it: on the first step, before any
    update, the two losses differ by exactly that."""
    config = load_checkpoint(base).config
    moe = ModelConfig(**{**config.__dict__, "family": "qwen3_moe", "qk_norm": True,
                         "n_experts": 4, "n_experts_per_token": 2, "moe_ffn_hidden_dim": 32})
    torch.manual_seed(2)
    student = save_checkpoint(Transformer(moe), tmp_path / "student", tokenizer=base)
    first: dict[str, dict] = {}
    for name, extra in (("plain", {}), ("balanced", {"router_aux_loss_coef": 0.5})):
        out = tmp_path / name
        assert main(["distill", *quick(out, student, teacher=teacher, max_steps=1, **{
            "eval.every": 100, "ce_weight": 0.0, **extra})]) == 0
        first[name] = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text()
                                          .splitlines()) if "router/aux_loss" in r)
    plain, balanced = first["plain"], first["balanced"]
    assert plain["router/aux_loss"] == pytest.approx(balanced["router/aux_loss"], rel=1e-6)
    assert balanced["loss"] - plain["loss"] == pytest.approx(
        0.5 * plain["router/aux_loss"], rel=1e-4)


def test_teacher_data_mode_writes_answers_and_fine_tunes(base, teacher, tmp_path):
    """The teacher answers a weighted mixture of prompt sets; the student trains packed."""
    out = tmp_path / "data"
    mixture = "[{source: 'task:arithmetic', weight: 3}, {source: 'task:arithmetic3'}]"
    assert main(["distill", *quick(out, base, teacher=teacher, mode="teacher_data",
                                   max_steps=4, micro_batch_size=2,
                                   **{"data.limit": 16, "eval.every": 4, "data.train": mixture,
                                      "data.packing": "true", "max_completion_tokens": 4})]) == 0
    rows = [json.loads(line) for line in (out / "teacher_data.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and rows[0]["messages"][-1]["role"] == "assistant"
    drawn = load_mixture([WeightedSource("task:arithmetic", 3), WeightedSource("task:arithmetic3")],
                         load_prompt_dataset, "train", 16, seed=0)
    assert drawn.drawn == [12, 4]
    assert [row["messages"][-2]["content"] for row in rows] == [
        row.prompt[-1]["content"] for row in drawn.rows]
    assert (out / "final" / "model.safetensors").is_file()


def test_different_tokenizers_are_refused(base, tmp_path):
    other = train_tokenizer(["completely different text " * 20], vocab_size=300,
                            show_progress=False)
    save_tokenizer(other, tmp_path / "tok")
    with pytest.raises(ConfigError, match="must share a tokenizer"):
        check_same_tokenizer(str(base), str(tmp_path / "tok"))


@pytest.mark.parametrize("kind,beta", [("reverse_kl", 1.0), ("forward_kl", 0.0), ("jsd", 0.3)])
def test_divergences_equal_trls_distillation_trainer(kind, beta):
    """TRL 1.16's DistillationTrainer (on-policy GKD) scores the same student and teacher
    hidden states through their heads to the same loss at T=1 — its `beta` is our choice of
    divergence — and at T=2 to 1/T² of ours (lathe keeps Hinton's T² scaling, which holds
    the gradient's size as T changes; TRL does not)."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss
    g = torch.Generator().manual_seed(0)
    hidden_s, hidden_t = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    head_s, head_t = (0.3 * torch.randn(40, 16, generator=g) for _ in range(2))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    for temperature in (1.0, 2.0):
        theirs, _, _ = _chunked_divergence_loss(hidden_s, hidden_t, head_s, head_t, mask, beta,
                                                temperature=temperature)
        ours = kd_loss(hidden_s @ head_s.T, hidden_t @ head_t.T, mask.bool(), kind,
                       temperature, beta if kind == "jsd" else 0.5)
        assert ours.item() == pytest.approx(theirs.item() * temperature**2, rel=1e-5)


ON_POLICY = {"mode": "on_policy", "loss": "reverse_kl", "micro_batch_size": 8,
             "optim.lr": 3e-3, "max_completion_tokens": 8}


def test_on_policy_distillation_lowers_the_students_reverse_kl(base, teacher, tmp_path):
    """The student samples its own answers and learns the teacher's distributions on them:
    its KL to the teacher on its own samples of held-out prompts falls within 20 steps."""
    out = tmp_path / "on_policy"
    assert main(["distill", *quick(out, base, teacher=teacher, max_steps=20, **ON_POLICY, **{
        "eval.every": 20, "logging.log_every": 1})]) == 0
    summary = json.loads((out / "summary.json").read_text())
    first, last = summary["reverse_kl"]
    assert last < 0.85 * first
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lengths = [r["completion/mean_length"] for r in records if "completion/mean_length" in r]
    assert len(lengths) == 20 and all(0 < n <= 8 for n in lengths)
    assert {"student_accuracy", "teacher_accuracy"} <= set(summary)


def test_on_policy_refuses_a_cross_entropy_on_its_own_samples():
    from lathe.posttrain.config import DistillConfig
    assert DistillConfig(mode="on_policy").ce_weight == 0.0
    assert DistillConfig().ce_weight == 0.5
    with pytest.raises(ConfigError, match="ce_weight=0.5 with mode=on_policy"):
        DistillConfig(mode="on_policy", ce_weight=0.5)


def test_on_policy_distillation_resumes_exactly_after_kill_9(base, teacher, tmp_path):
    settings = {**ON_POLICY, "eval.every": 100, "checkpoint.every": 2, "logging.log_every": 1,
                "teacher": teacher, "data.limit": 256}
    whole, killed = killed_and_resumed("lathe.posttrain.distill", base, tmp_path, 5, **settings)

    def losses(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["loss"], r["completion/mean_length"]) for r in rows
                if "loss" in r}
    expected, got = losses(whole), losses(killed)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in (3, 4, 5):
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step


def test_a_reward_mixes_reinforce_into_the_divergence():
    """DistillationLoss with advantages: the divergence plus reward_weight × the mean over
    labelled tokens of each row's advantage times −log p at the sampling temperature."""
    from lathe.posttrain.config import DistillConfig, RewardSpec
    from lathe.posttrain.divergence import DistillationLoss, kd_per_token
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    labels = torch.tensor([[-100, -100, 3, 4, 5], [-100, 7, 8, -100, -100]])
    advantages = torch.tensor([0.8, -0.5])
    config = DistillConfig(mode="on_policy", loss="reverse_kl", temperature=2.0,
                           rewards=[RewardSpec("exact_number")], reward_weight=0.3)
    flat_teacher = teacher[:, :-1].flatten(0, 1)
    op = DistillationLoss(labels, lambda rows: flat_teacher[rows], config, advantages)
    loss = op.from_logits(student)
    mask = labels[:, 1:] != -100
    kd = kd_per_token(student[:, :-1], teacher[:, :-1], "reverse_kl", 2.0)
    nll = -torch.log_softmax(student[:, :-1] / 2.0, -1).gather(
        2, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
    expected = ((kd + 0.3 * advantages[:, None] * nll) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert op.parts["pg"].item() == pytest.approx(
        ((advantages[:, None] * nll) * mask).sum().item() / mask.sum().item(), rel=1e-5)
    # the chunked path takes the 5 labelled positions of 8 through the head, each with its
    # own row's advantage: the same loss and gradient as the whole logits
    hidden = torch.randn(2, 5, 4, generator=g, requires_grad=True)
    weight = torch.randn(11, 4, generator=g)
    chunked = op.chunked(hidden, weight, None)
    whole = op.from_logits(hidden @ weight.T)
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-5)
    torch.testing.assert_close(torch.autograd.grad(chunked, hidden)[0],
                               torch.autograd.grad(whole, hidden)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="a reward mixes into mode=on_policy only"):
        DistillConfig(rewards=[RewardSpec("exact_number")], reward_weight=0.3)
    with pytest.raises(ConfigError, match="a reward mixes into mode=on_policy only"):
        DistillConfig(mode="on_policy", reward_weight=0.3)


def test_on_policy_distillation_climbs_a_mixed_in_reward(base, teacher, tmp_path):
    """A reward for digits mixed in: the student's samples earn more of it as it trains."""
    out = tmp_path / "rewarded"
    assert main(["distill", *quick(out, base, teacher=teacher, max_steps=20, **ON_POLICY, **{
        "eval.every": 20, "logging.log_every": 1, "reward_weight": 2.0,
        "rewards": '[{name: "tests.posttrain.test_stages:digit_share"}]'})]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    reward = [r["reward/mean"] for r in records if "reward/mean" in r]
    assert len(reward) == 20 and sum(reward[-5:]) > 2 * sum(reward[:5])
    assert all("pg" in r for r in records if "loss" in r)
