"""`lathe rm`: TRL's RewardTrainer loss, a reward model that learns a preference and exports
as the family's sequence classifier with transformers' scores, and GRPO rewarded by it."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from lathe.core.cli import main
from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import chat_encoder
from lathe.data.formats import load_preference_dataset
from lathe.data.tasks import task_examples
from lathe.model.lora import LoraSection
from lathe.posttrain.common import pad, pad_id
from lathe.posttrain.config import GRPOConfig, RewardSpec, RMConfig
from lathe.posttrain.reward_model import RewardModelScorer, bradley_terry_loss
from tests.posttrain.conftest import quick

transformers = pytest.importorskip("transformers")


def trl_reward_loss(chosen, rejected, margin, center):
    """TRL 1.16's RewardTrainer.compute_loss, its lines in order."""
    if margin is not None:
        loss = -F.logsigmoid(chosen - rejected - margin).mean()
    else:
        loss = -F.logsigmoid(chosen - rejected).mean()
    if center is not None:
        loss += center * torch.mean((chosen + rejected) ** 2)
    return loss


@pytest.mark.parametrize("margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_bradley_terry_loss_equals_trls(margin, center):
    g = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(6, generator=g), torch.randn(6, generator=g)
    margins = torch.rand(6, generator=g) if margin else None
    loss, metrics = bradley_terry_loss(chosen, rejected, margins, center)
    assert loss.item() == pytest.approx(trl_reward_loss(chosen, rejected, margins,
                                                        center).item(), rel=1e-6)
    assert metrics["rewards/accuracy"].item() == (chosen > rejected).float().mean().item()


def test_reward_settings_and_margins_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="give a reward function's name or a reward model's"):
        RewardSpec()
    with pytest.raises(ConfigError, match="one of them"):
        RewardSpec(name="exact_number", model="runs/rm/final")
    assert GRPOConfig().rewards == [RewardSpec("exact_number")]
    RMConfig(lora=LoraSection(enabled=True))
    with pytest.raises(ConfigError, match="a reward model has no LM head"):
        RMConfig(lora=LoraSection(enabled=True, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ConfigError, match="full-precision decoder"):
        RMConfig(lora=LoraSection(enabled=True, qlora=True))
    rows = tmp_path / "pairs.jsonl"
    rows.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5",
                                "margin": 1.5}) + "\n")
    assert load_preference_dataset(str(rows))[0].margin == 1.5
    rows.write_text(json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5",
                                "margin": "big"}) + "\n")
    with pytest.raises(ConfigError, match="margin='big' must be a finite number"):
        load_preference_dataset(str(rows))


def digit_preferences(folder) -> dict[str, object]:
    """Arithmetic prompts whose chosen reply is digits and rejected one words: a preference a
    tiny random policy can climb (its samples hold a few digits by chance)."""
    rng = random.Random(0)
    words = "the river ran past old mill and quiet town stood near hills road garden".split()
    files = {}
    for split in ("train", "test"):
        rows = []
        for example in task_examples("arithmetic", split, 300):
            n = rng.randint(1, 6)
            rows.append({"prompt": example.prompt,
                         "chosen": "".join(rng.choice("0123456789") for _ in range(n)),
                         "rejected": " ".join(rng.choice(words) for _ in range(max(1, n // 2)))})
        files[split] = folder / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return files


def trained_reward_model(base, tmp_path_factory, name: str, **settings) -> tuple:
    """A reward model of the base's decoder that prefers digits to words, its run folder and
    the preference files."""
    root = tmp_path_factory.mktemp(name)
    files = digit_preferences(root)
    out = root / "rm"
    assert main(["rm", *quick(out, base, max_steps=30, micro_batch_size=8, **{
        "eval.every": 30, "data.train": files["train"], "data.eval": files["test"],
        **settings})]) == 0
    return out, files


@pytest.fixture(scope="module")
def reward_model(base, tmp_path_factory):
    return trained_reward_model(base, tmp_path_factory, "rm", **{"optim.lr": 1e-3})


@pytest.fixture(scope="module")
def lora_reward_model(base, tmp_path_factory):
    """The same, trained through LoRA adapters (its score head whole)."""
    return trained_reward_model(base, tmp_path_factory, "rm-lora", **{
        "optim.lr": 3e-3, "lora.enabled": "true", "lora.r": 8})


@pytest.mark.parametrize("trained", ["reward_model", "lora_reward_model"])
def test_a_reward_model_learns_the_preference_and_exports_transformers_scores(trained, request):
    out, files = request.getfixturevalue(trained)
    accuracy = json.loads((out / "summary.json").read_text())["preference_accuracy"]
    assert accuracy[0] < 0.5 and accuracy[-1] >= 0.9
    written = json.loads((out / "final" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForSequenceClassification"]
    scorer = RewardModelScorer(out / "final", torch.device("cpu"))
    rows = load_preference_dataset(str(files["test"]), limit=6)
    conversations = [r.prompt + r.chosen for r in rows] + [r.prompt + r.rejected for r in rows]
    ours = torch.tensor(scorer(conversations))
    assert (ours[:6] > ours[6:]).all()
    encoder = chat_encoder(out / "final")
    assert written["pad_token_id"] == pad_id(encoder.tokenizer)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        out / "final", dtype=torch.float32).eval()
    ids = pad([encoder.encode(encoder.render(c, None, add_generation_prompt=False))
               for c in conversations], written["pad_token_id"])  # one padded batch
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits[:, 0], ours, atol=1e-4, rtol=1e-4)


def test_grpo_rewarded_by_the_reward_model_raises_its_score(base, reward_model, tmp_path):
    out = tmp_path / "grpo"
    rm, _ = reward_model
    rewards = f'[{{model: "{rm / "final"}"}}]'
    assert main(["grpo", *quick(out, base, max_steps=16, rewards=rewards, **{
        "optim.lr": 3e-3, "eval.every": 16, "prompts_per_step": 6, "num_generations": 6,
        "max_completion_tokens": 6})]) == 0
    reward = json.loads((out / "summary.json").read_text())["reward"]  # each step's new prompts
    assert sum(reward[-4:]) / 4 > sum(reward[:4]) / 4 + 0.5
    with pytest.raises(ConfigError, match="is a language model, not a reward model"):
        RewardModelScorer(base, torch.device("cpu"))


def test_what_generates_text_refuses_a_reward_model(reward_model, tmp_path, capsys):
    rm = reward_model[0] / "final"
    assert main(["generate", str(rm), "--prompt", "2 + 2 ="]) == 2
    assert "generate needs a language model; this checkpoint is a sequence classifier" in \
        capsys.readouterr().err
    assert main(["export", str(rm), "--format", "gguf", "--out", str(tmp_path / "rm.gguf")]) == 2
    assert "a sequence classifier (a reward model) has no LM head" in capsys.readouterr().err
    from lathe.serve.engine import LLMEngine
    with pytest.raises(ConfigError, match="needs a language model"):
        LLMEngine.from_checkpoint(rm)
