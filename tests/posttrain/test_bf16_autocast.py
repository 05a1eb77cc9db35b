"""Every post-training stage, a few steps under bf16 autocast, with the Triton kernels forced
on (Triton's interpreter) and off: the dtype paths a GPU run takes — policy, reference, teacher,
rollout engine, task evaluation's KV cache, a mixture of experts' balance loss — so a
bf16/fp32 mix fails here, not on the first GPU run. (The numbers mean nothing: Triton's
interpreter computes bf16 wrongly, so only the dtypes and that every stage runs are
checked.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lathe.core.cli import main
from lathe.model import ModelConfig, Transformer, load_checkpoint, save_checkpoint
from tests.posttrain.conftest import quick

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_base(base, tmp_path_factory) -> Path:
    """`base`'s tokenizer with a one-layer, 32-wide model: seconds per stage even with
    bf16 on this CPU and every kernel interpreted."""
    config = load_checkpoint(base).config
    small = ModelConfig.from_preset("tiny", vocab_size=config.vocab_size, n_layers=1, dim=32,
                                    n_heads=2, n_kv_heads=1, ffn_hidden_dim=64, max_seq_len=64)
    torch.manual_seed(0)
    return save_checkpoint(Transformer(small), tmp_path_factory.mktemp("bf16") / "base",
                           tokenizer=base)


@pytest.fixture(autouse=True, params=["force", "0"])
def kernels(request, monkeypatch):
    """With every kernel forced on (interpreted) and with none: both dtype paths."""
    monkeypatch.setenv("LATHE_KERNELS", request.param)


def bf16(stage: str, out: Path, model: Path, **extra) -> list[str]:
    """`stage`'s command line for two steps of two rows under bf16, reading 16 of the task's
    rows (GRPO: of its prompts; rendering and tokenizing all 13,564 took most of a run)."""
    rows = {"limit": 16} if stage == "grpo" else {"data.limit": 16}
    return [stage, *quick(out, model, max_steps=2, micro_batch_size=2, **{
        **rows, "precision.mixed_precision": "bf16", "task_eval.examples": 2,
        "task_eval.max_tokens": 2, "eval.batches": 1, "eval.every": 2, **extra})]


def exported_dtypes(folder: Path) -> set[str]:
    with safe_open(folder / "model.safetensors", "pt") as weights:
        return {weights.get_slice(name).get_dtype() for name in weights.keys()}  # noqa: SIM118


def first_loss(out: Path) -> float:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in records if "loss" in r)


@pytest.mark.parametrize("fp8, packing", [(False, False), (True, False), (False, True)])
def test_sft_in_bf16(small_base, tmp_path, fp8, packing):
    """With FP8 too: the task evaluation's engine runs the converted policy; and packed
    (forced: the Triton attention kernel's document path)."""
    out = tmp_path / "sft"
    assert main(bf16("sft", out, small_base, **{
        "data.max_len": 64 if packing else 32, "data.packing": str(packing).lower(),
        "precision.fp8": str(fp8).lower()})) == 0
    assert math.isfinite(first_loss(out))
    assert exported_dtypes(out / "final") == {"BF16"}


def test_dpo_in_bf16_starts_at_log_2(small_base, tmp_path):
    """The reference log-probs are computed in the policy's autocast, so at step 1 policy
    and reference agree exactly and the sigmoid loss is log 2."""
    out = tmp_path / "dpo"
    assert main(bf16("dpo", out, small_base, **{"data.train": "task:arithmetic",
                                                  "data.max_len": 32, "data.limit": 8})) == 0
    assert first_loss(out) == pytest.approx(math.log(2), abs=1e-6)
    assert exported_dtypes(out / "final") == {"BF16"}


@pytest.fixture(scope="module")
def small_moe(base, tmp_path_factory) -> Path:
    """`small_base`'s shape as a Qwen3-MoE of four experts, two a token."""
    config = load_checkpoint(base).config
    moe = ModelConfig.from_preset("tiny", vocab_size=config.vocab_size, n_layers=1, dim=32,
                                  n_heads=2, n_kv_heads=1, ffn_hidden_dim=64, max_seq_len=64,
                                  family="qwen3_moe", qk_norm=True, n_experts=4,
                                  n_experts_per_token=2, moe_ffn_hidden_dim=32)
    torch.manual_seed(0)
    return save_checkpoint(Transformer(moe), tmp_path_factory.mktemp("bf16") / "moe",
                           tokenizer=base)


@pytest.mark.parametrize("stage", ["dpo", "grpo"])
def test_a_mixture_of_experts_adds_its_balance_loss_in_bf16(small_moe, tmp_path, stage):
    """DPO's and GRPO's own losses add the experts' balance loss under autocast: finite,
    and logged each step."""
    out = tmp_path / stage
    extra = ({"prompts_per_step": 2, "num_generations": 2, "max_completion_tokens": 3}
             if stage == "grpo" else {"data.train": "task:arithmetic", "data.max_len": 32,
                                      "data.limit": 8})
    assert main(bf16(stage, out, small_moe, **extra)) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    balance = [r["router/aux_loss"] for r in records if "router/aux_loss" in r]
    assert len(balance) == 2 and all(math.isfinite(b) and b > 0.9 for b in balance)
    assert math.isfinite(first_loss(out))


def count_weight_reads(monkeypatch) -> list[Path]:
    """Every safetensors file a run reads, in order."""
    from lathe.model import checkpoint
    reads, real = [], checkpoint.load_safetensors
    monkeypatch.setattr(checkpoint, "load_safetensors",
                        lambda file, device: reads.append(Path(file)) or real(file, device))
    return reads


@pytest.mark.parametrize("lora", [False, True])
def test_grpo_in_bf16_with_a_reference(small_base, tmp_path, lora, monkeypatch):
    """...and the policy, its reference and the rollout engine's copy come from one read of
    the checkpoint's weights."""
    reads = count_weight_reads(monkeypatch)
    out = tmp_path / "grpo"
    assert main(bf16("grpo", out, small_base, prompts_per_step=2, num_generations=2,
                               max_completion_tokens=3, beta=0.04,
                               **{"lora.enabled": str(lora).lower()})) == 0
    assert math.isfinite(first_loss(out))
    assert [file.parent for file in reads].count(small_base) == 1


def test_logit_distillation_in_bf16(small_base, tmp_path, monkeypatch):
    """Packed: the teacher reads the rows' documents as the student does."""
    reads = count_weight_reads(monkeypatch)
    out = tmp_path / "distill"
    assert main(bf16("distill", out, small_base, teacher=small_base, **{
        "data.max_len": 64, "data.packing": "true"})) == 0
    assert math.isfinite(first_loss(out))
    # the student once; the teacher once, for training and for its score
    assert [file.parent for file in reads].count(small_base) == 2


def test_on_policy_distillation_in_bf16(small_base, tmp_path):
    """The student's samples from its rollout engine (a bf16 KV cache), scored against the
    teacher under autocast: a finite loss and held-out KL, the export in bf16 as every
    stage's."""
    out = tmp_path / "on_policy"
    assert main(bf16("distill", out, small_base, teacher=small_base, mode="on_policy",
                                  loss="reverse_kl", max_completion_tokens=4)) == 0
    assert math.isfinite(first_loss(out))
    kl = json.loads((out / "summary.json").read_text())["reverse_kl"]
    assert kl[0] == pytest.approx(0.0, abs=1e-2)  # a teacher equal to the student
    assert all(math.isfinite(value) for value in kl)
    assert exported_dtypes(out / "final") == {"BF16"}


def test_reward_model_in_bf16(small_base, tmp_path):
    """The score head under autocast: the first Bradley–Terry loss is log 2 (a fresh head
    scores both replies ~0) and the export is a sequence classifier."""
    out = tmp_path / "rm"
    assert main(bf16("rm", out, small_base, **{"data.max_len": 64})) == 0
    assert first_loss(out) == pytest.approx(math.log(2), abs=0.05)
    assert load_checkpoint(out / "final").config.num_labels == 1
    assert exported_dtypes(out / "final") == {"BF16"}
