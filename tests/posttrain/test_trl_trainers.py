"""`lathe sft` and `lathe dpo` step for step against TRL 1.16's trainers: SFT on prompt and
completion (SFTTrainer), DPO with and without RPO's NLL term and IPO (DPOTrainer), SimPO with
and without CPO's NLL term (CPOTrainer), ORPO (ORPOTrainer) and KTO (KTOTrainer). Both sides
start from the same Qwen2 checkpoint that transformers wrote (lathe's tokenizer and chat
template) and read the same conversational rows; the batch is the whole dataset, so the
trainers' different shuffles draw the same steps. Every step's loss and gradient norm and the
final weights must agree within float noise. A Qwen3-MoE trains SFT and DPO with its balance
loss, as TRL 1.16's trainers add it."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from lathe.core.cli import main
from lathe.data.tasks import task_examples
from lathe.data.tokenizer import load_tokenizer
from lathe.model.checkpoint import TOKENIZER_FILES
from tests.builders import reset_accelerate
from tests.posttrain.conftest import quick

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")

STEPS = 4
# lathe's loss settings and TRL's trainer, config class and settings for each case
CASES = {
    # SFTTrainer's loss on a prompt-completion dataset is the completion's (its default
    # completion_only_loss), what lathe trains of the same chat: the assistant's reply
    "sft": ({}, "trl.SFTTrainer", {}),
    "dpo": ({"loss": "sigmoid", "beta": 0.1}, "trl.DPOTrainer", {"beta": 0.1}),
    # RPO, as the README's DPO stage runs it: TRL 1.16 spells it as a second, "sft" loss
    "dpo+nll": ({"loss": "sigmoid", "beta": 0.1, "rpo_alpha": 1.0}, "trl.DPOTrainer",
                {"beta": 0.1, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 1.0]}),
    "ipo": ({"loss": "ipo", "beta": 0.1}, "trl.DPOTrainer", {"beta": 0.1, "loss_type": ["ipo"]}),
    "simpo": ({"loss": "simpo", "beta": 2.0}, "trl.experimental.cpo.CPOTrainer",
              {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0}),
    "simpo+nll": ({"loss": "simpo", "beta": 2.0, "rpo_alpha": 1.0},
                  "trl.experimental.cpo.CPOTrainer",
                  {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 1.0}),
    "orpo": ({"loss": "orpo", "beta": 0.1}, "trl.experimental.orpo.ORPOTrainer",
             {"beta": 0.1}),
    "kto": ({"loss": "kto", "beta": 0.1}, "trl.KTOTrainer", {"beta": 0.1}),
    "kto-weighted": ({"loss": "kto", "beta": 0.1, "desirable_weight": 1.33,
                      "undesirable_weight": 0.8}, "trl.KTOTrainer",
                     {"beta": 0.1, "desirable_weight": 1.33, "undesirable_weight": 0.8}),
}


def checkpoint(base: Path, folder: Path, family: str, **settings) -> Path:
    """A `family` checkpoint (transformers' class, random weights) with `base`'s tokenizer,
    whose pad id is the tokenizer's own pad token: transformers builds the embedding with
    `padding_idx=pad_token_id`, which never updates that row through the lookup, so a pad id
    that the text uses (the BOS, say) would train differently."""
    tokenizer = load_tokenizer(base)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id("<|begin_of_text|>"),
        eos_token_id=tokenizer.token_to_id("<|end_of_turn|>"),
        pad_token_id=tokenizer.token_to_id("<|pad|>"), **settings)
    torch.manual_seed(0)
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def qwen2(base, tmp_path_factory) -> Path:
    return checkpoint(base, tmp_path_factory.mktemp("trl") / "qwen2", "Qwen2")


@pytest.fixture(scope="module")
def qwen3_moe(base, tmp_path_factory) -> Path:
    """Four experts, two a token, and a balance-loss coefficient (0.05, over the class's
    0.001) at which the term weighs in the loss well beyond float noise."""
    return checkpoint(base, tmp_path_factory.mktemp("trl") / "qwen3_moe", "Qwen3Moe",
                      head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, router_aux_loss_coef=0.05)


def rows(case: str) -> list[dict]:
    """Four arithmetic pairs (the answer chosen, a refusal rejected) in TRL's conversational
    format, or for KTO their eight completions, each labelled, or for SFT the four prompts
    and answers."""
    pairs = [{"prompt": [{"role": "user", "content": r.prompt}],
              "chosen": [{"role": "assistant", "content": r.answer}],
              "rejected": [{"role": "assistant", "content": "I do not know."}]}
             for r in task_examples("arithmetic", "train", 4)]
    if case == "sft":
        return [{"prompt": p["prompt"], "completion": p["chosen"]} for p in pairs]
    if not case.startswith("kto"):
        return pairs
    return [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected")]


def trl_run(case: str, model: Path, out: Path, **extra) -> tuple[list[float], list[float], dict]:
    """TRL's trainer for `case` on the rows (`extra` settings added), every step's loss as
    its `compute_loss` returns it, every step's gradient norm as it logs it, and the trained
    weights."""
    _, path, settings = CASES[case]
    settings = {**settings, **extra}
    module, name = path.rsplit(".", 1)
    trainer_class = getattr(importlib.import_module(module), name)
    config_class = getattr(importlib.import_module(module), name.replace("Trainer", "Config"))
    data = rows(case)
    args = config_class(output_dir=str(out), per_device_train_batch_size=len(data),
                        max_steps=STEPS, learning_rate=1e-3, lr_scheduler_type="constant",
                        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, seed=0,
                        max_length=128, report_to="none", save_strategy="no", use_cpu=True,
                        bf16=False, disable_tqdm=True, **settings)
    losses = []

    class Recording(trainer_class):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            result = super().compute_loss(model, inputs, return_outputs, **kwargs)
            losses.append((result[0] if return_outputs else result).item())
            return result

    trainer = Recording(
        model=transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
        args=args, train_dataset=datasets.Dataset.from_list(data),
        processing_class=transformers.AutoTokenizer.from_pretrained(model))
    trainer.train()
    reset_accelerate()  # the Trainer's accelerate state is process-wide; lathe builds its own
    norms = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    return losses, norms, trainer.model.state_dict()


def lathe_run(case: str, model: Path, out: Path, **extra) -> tuple[list[float], list[float],
                                                                    dict]:
    """`lathe dpo` (`lathe sft` for SFT, on the rows as chats) on the same rows with TRL's
    optimizer settings: AdamW (0.9, 0.999) at a constant 1e-3, no weight decay, gradients
    clipped at 1 (`extra` overrides added)."""
    data, records, stage = out.parent / f"{out.name}.jsonl", rows(case), "dpo"
    if case == "sft":
        records, stage = [{"messages": r["prompt"] + r["completion"]} for r in records], "sft"
    data.write_text("".join(json.dumps(row) + "\n" for row in records))
    settings, _, _ = CASES[case]
    overrides = {**settings, "data.train": data, "data.eval": data,
                 "micro_batch_size": len(records), "task_eval.examples": 0,
                 "schedule.kind": "constant", "schedule.warmup_steps": 0, "optim.lr": 1e-3,
                 "optim.weight_decay": 0.0, "optim.betas": "[0.9,0.999]",
                 "optim.grad_clip": 1.0, "eval.every": 1000, **extra}
    assert main([stage, *quick(out, model, max_steps=STEPS, **overrides)]) == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in logged if "grad_norm" in record]
    trained = transformers.AutoModelForCausalLM.from_pretrained(out / "final",
                                                                dtype=torch.float32)
    return ([r["loss"] for r in steps], [r["grad_norm"] for r in steps],
            trained.state_dict())


@pytest.mark.parametrize("case", list(CASES))
def test_a_preference_loss_trains_step_for_step_as_trls_trainer(case, qwen2, tmp_path):
    theirs = trl_run(case, qwen2, tmp_path / "trl")
    ours = lathe_run(case, qwen2, tmp_path / "lathe")
    assert len(ours[0]) == len(theirs[0]) == STEPS
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5, abs=1e-6)
    assert ours[1] == pytest.approx(theirs[1], rel=1e-4)
    assert theirs[0][-1] < theirs[0][0]  # the steps train: the comparison is not of no-ops
    assert ours[2].keys() == theirs[2].keys()
    for name, weight in theirs[2].items():
        torch.testing.assert_close(ours[2][name], weight, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("coef", [None, 0.0])
@pytest.mark.parametrize("case", ["sft", "dpo"])
def test_a_mixture_of_experts_trains_with_its_balance_loss_as_trls_trainer(case, coef,
                                                                          qwen3_moe, tmp_path):
    """TRL 1.16's SFTTrainer and DPOTrainer add router_aux_loss_coef (the checkpoint's unless
    set) times the balance loss of the batch's routing, pads left out; 0 turns it off.
    `lathe sft` and `lathe dpo` train step for step the same either way, and the term is no
    rounding: the two settings' losses differ."""
    settings = {} if coef is None else {"router_aux_loss_coef": coef}
    theirs = trl_run(case, qwen3_moe, tmp_path / "trl", **settings)
    ours = lathe_run(case, qwen3_moe, tmp_path / "lathe", **settings)
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5, abs=1e-6)
    assert ours[1] == pytest.approx(theirs[1], rel=1e-4)
    for name, weight in theirs[2].items():  # Adam turns the float noise of a near-zero
        # gradient (routing adds some) into a step of up to the rate: a tenth of one is noise
        torch.testing.assert_close(ours[2][name], weight, atol=1e-4, rtol=1e-4, msg=name)
    logged = [json.loads(line) for line in
              (tmp_path / "lathe" / "metrics.jsonl").read_text().splitlines()]
    balance = [r["router/aux_loss"] for r in logged if "router/aux_loss" in r]
    assert len(balance) == STEPS and all(b > 0.9 for b in balance)  # ~1 when balanced
    if coef is None:
        assert abs(ours[0][0] - lathe_run(case, qwen3_moe, tmp_path / "off",
                                          router_aux_loss_coef=0)[0][0]) > 0.02
