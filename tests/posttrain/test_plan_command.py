"""`lathe plan`: every stage plans from its recipe and a launch file without loading a
weight; LoRA, a teacher and a rollout engine show where they should; `--memory` finds a
micro-batch that fits; bad input is one line naming the fix. A stage prints the same plan
at its start and its measured peak beside it at the end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lathe.core.cli import run_command
from lathe.posttrain.plan_bench import PlanCase, measure, plan_checkpoint
from lathe.posttrain.sft import main as sft_main
from tests.posttrain.conftest import quick

ROOT = Path(__file__).parents[2]
ZERO3 = str(ROOT / "recipes" / "accelerate" / "8gpu-zero3.yaml")


def plan(capsys, *argv: str) -> str:
    assert run_command("plan", list(argv)) == 0
    return capsys.readouterr().out


def peak_of(text: str) -> float:
    """The plan's peak in GiB."""
    value, unit = re.search(r"peak\s+([\d.]+) (GiB|MiB)", text).groups()
    return float(value) / (1 if unit == "GiB" else 1024)


def test_each_post_training_stage_plans_a_checkpoint(capsys, base):
    common = ["--model", str(base), "--launch", ZERO3]
    sft = plan(capsys, "sft", *common)
    assert "ZeRO-3 × 8 ranks, bf16 on cuda" in sft and "micro-batch 8 × 128 tokens" in sft
    dpo = plan(capsys, "dpo", *common)
    assert "micro-batch 16 × 128 tokens" in dpo  # chosen and rejected rows
    grpo = plan(capsys, "grpo", *common, "--max_completion_tokens=16")
    assert "KV cache" in grpo  # the rollout engine's
    # a server the run starts holds the same engine on the same card; one elsewhere, none
    local = plan(capsys, "grpo", *common, "--max_completion_tokens=16", "--rollout.url=local")
    assert peak_of(local) == peak_of(grpo)
    remote = plan(capsys, "grpo", *common, "--max_completion_tokens=16",
                  "--rollout.url=http://rollouts:8000", "--rollout.weights_dir=/shared")
    assert peak_of(remote) < peak_of(grpo) and "KV cache" not in remote
    distill = plan(capsys, "distill", *common, "--teacher", str(base))
    assert peak_of(distill) > peak_of(sft)  # the teacher's weights
    on_policy = plan(capsys, "distill", *common, "--teacher", str(base), "--mode=on_policy")
    assert "KV cache" in on_policy and peak_of(on_policy) > peak_of(distill)  # its engine
    rm = plan(capsys, "rm", *common)
    assert "micro-batch 16 × 128 tokens" in rm and "logits / loss" not in rm  # a score head
    lora = plan(capsys, "sft", *common, "--lora.enabled=true")
    assert re.search(r"\(0\.\d+M trained\)", lora)


def test_pretraining_plans_from_its_preset(capsys, tmp_path):
    out = plan(capsys, "pretrain", "--model.preset=nano", "--model.overrides.vocab_size=32000",
               "--data.seq_len=1024", "--micro_batch_size=4", "--device=cpu")
    assert "one process, fp32 on cpu" in out and "micro-batch 4 × 1024 tokens" in out
    assert run_command("plan", ["pretrain", "--model.overrides.vocab_size=512",
                                "--no_such_field=1"]) == 2
    assert "no_such_field" in capsys.readouterr().err


def test_memory_finds_the_largest_micro_batch(capsys, base):
    out = plan(capsys, "sft", "--model", str(base), "--launch", ZERO3, "--memory", "2")
    best = int(re.search(r"fits 2 GiB: (\d+) \(peak ", out).group(1))
    assert best >= 1
    more = plan(capsys, "sft", "--model", str(base), "--launch", ZERO3,
                f"--micro_batch_size={best + 1}")
    assert peak_of(more) > 2 * 0.999
    tight = plan(capsys, "sft", "--model", str(base), "--memory", "0.001")
    assert "no micro-batch fits 0.001 GiB" in tight


def test_bad_input_is_one_line(capsys, base, tmp_path):
    assert run_command("plan", ["sft", "--model", str(base), "--launch",
                                str(tmp_path / "x.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert run_command("plan", ["sft", "--model", str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err
    assert run_command("plan", ["sft", "--model", str(base), "--memory", "-1"]) == 2
    assert "--memory=-1" in capsys.readouterr().err
    assert run_command("plan", ["pretrain", f"--data.tokenizer={tmp_path / 'none'}"]) == 2
    assert "vocab_size" in capsys.readouterr().err


def test_a_stage_prints_its_plan_and_reports_its_peak(capsys, base, tmp_path):
    assert sft_main(["--max_steps=1", *quick(tmp_path / "sft", base)]) == 0
    out = capsys.readouterr().out
    assert "memory plan, per rank: one process" in out
    assert re.search(r"peak memory [\d.]+ GiB a rank \(planned [\d.]+ GiB\)", out)
    memory = json.loads((tmp_path / "sft" / "summary.json").read_text())["memory"]
    assert memory["peak_gib"] > 0 and memory["plan_gib"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    PlanCase("LoRA, FSDP2 × 2, checkpointing", "cpu-fsdp2", lora=True, checkpointing=True),
    PlanCase("full, ZeRO-3 × 2", "cpu-zero3"),
], ids=["lora-fsdp2-checkpointing", "zero3"])
def test_a_two_process_run_peaks_within_15_percent_of_its_plan(tmp_path, case):
    """The bench's check (`python -m lathe.posttrain.bench --only plan`) on two of its
    launches, at a smaller model: the largest rank's measured peak against the plan."""
    checkpoint = plan_checkpoint(tmp_path / "model", dim=512, layers=4)
    memory = measure(case, checkpoint, tmp_path)
    assert abs(memory["plan_gib"] / memory["peak_gib"] - 1) < 0.15, memory
