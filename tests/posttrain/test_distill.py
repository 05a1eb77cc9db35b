"""Distillation: KD losses against their formulas, the shared-tokenizer check, and short
runs in both modes."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from lathe.core.cli import main
from lathe.core.errors import ConfigError
from lathe.data.formats import load_prompt_dataset
from lathe.data.mixture import WeightedSource, load_mixture
from lathe.data.tokenizer import save_tokenizer, train_tokenizer
from lathe.model import ModelConfig, Transformer, load_checkpoint, save_checkpoint
from lathe.posttrain.distill import check_same_tokenizer, kd_loss
from tests.posttrain.conftest import quick


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


def test_teacher_data_mode_writes_answers_and_fine_tunes(base, teacher, tmp_path):
    """The teacher answers a weighted mixture of prompt sets; the student trains packed."""
    out = tmp_path / "data"
    mixture = "[{source: 'task:arithmetic', weight: 3}, {source: 'task:arithmetic3'}]"
    assert main(["distill", *quick(out, base, teacher=teacher, mode="teacher_data",
                                   max_steps=4, micro_batch_size=2,
                                   **{"data.limit": 16, "eval.every": 4, "data.train": mixture,
                                      "data.packing": "true", "teacher_max_tokens": 4})]) == 0
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
