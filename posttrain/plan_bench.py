"""Memory plans against measured peaks (`python -m lathe.posttrain.bench --only plan`).

Each configuration is a real `lathe sft` run — `accelerate launch` with one of the launch
files in recipes/accelerate, full fine-tuning or LoRA, activation checkpointing on or off —
of a random ~60M-parameter model on the embedded arithmetic chats packed into 512-token
rows, for three steps. The run prints its plan at start and writes the largest peak of
any rank beside it into summary.json (`Runtime.memory_report`): on CUDA
`max_memory_allocated`, on CPU the peak resident set above the process's size before the
model loaded, with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_) so that freed
large blocks go back to the system as a GPU allocator's do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from lathe.data.tasks import task_examples
from lathe.data.tokenizer import save_tokenizer, train_tokenizer
from lathe.model.checkpoint import save_checkpoint
from lathe.model.config import ModelConfig
from lathe.model.transformer import Transformer

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "accelerate"


@dataclass(frozen=True)
class PlanCase:
    label: str
    launch: str | None  # a recipes/accelerate file's stem; None: one process
    lora: bool = False
    checkpointing: bool = False
    micro_batch: int = 2


CASES = [
    PlanCase("full, one process", None),
    PlanCase("full, one process, checkpointing", None, checkpointing=True),
    PlanCase("LoRA, one process", None, lora=True),
    PlanCase("LoRA, one process, checkpointing", None, lora=True, checkpointing=True),
    PlanCase("full, DDP × 2", "cpu-ddp"),
    PlanCase("full, FSDP2 × 2", "cpu-fsdp2"),
    PlanCase("LoRA, FSDP2 × 2", "cpu-fsdp2", lora=True),
    PlanCase("full, ZeRO-2 × 2", "cpu-zero2"),
    PlanCase("full, ZeRO-3 × 2", "cpu-zero3"),
    PlanCase("full, ZeRO-3 × 2, checkpointing", "cpu-zero3", checkpointing=True),
]


def plan_checkpoint(folder: Path, dim: int = 768, layers: int = 8) -> Path:
    """A random model (`dim` wide, `layers` deep, a 4,096-token BPE trained on the
    arithmetic tasks) with lathe's chat template."""
    texts = [f"{r.prompt} {r.answer}" for task in ("arithmetic", "arithmetic3")
             for r in task_examples(task, "train", None)]
    save_tokenizer(train_tokenizer(texts, vocab_size=4096, max_digits=1, show_progress=False),
                   folder / "tokenizer")
    config = ModelConfig.from_preset("tiny", vocab_size=4096, dim=dim, n_layers=layers,
                                     n_heads=dim // 64, n_kv_heads=dim // 128, max_seq_len=512)
    torch.manual_seed(0)
    return save_checkpoint(Transformer(config), folder / "model", tokenizer=folder / "tokenizer")


def sft_recipe(case: PlanCase, checkpoint: Path, out_dir: Path) -> dict:
    return {
        "out_dir": str(out_dir), "model": str(checkpoint), "seed": 0,
        "micro_batch_size": case.micro_batch, "max_steps": 3,
        "precision": {"activation_checkpointing": case.checkpointing},
        "checkpoint": {"every": 1000}, "eval": {"every": 1000, "batches": 1},
        "logging": {"report_to": "none", "progress": False},
        "data": {"train": "task:arithmetic+arithmetic3", "max_len": 512, "packing": True,
                 "limit": 2000},
        "task_eval": {"prompts": "task:arithmetic", "task": "arithmetic", "examples": 2,
                      "max_tokens": 2},
        "lora": {"enabled": case.lora, "r": 16},
    }


def run_stage(label: str, stage: list[str], launch: str | None, timeout: float,
              **env: str) -> None:
    """`python -m <stage...>` to the end, in one process (`launch` None) or under
    `accelerate launch` with a recipes/accelerate file (its stem), W&B off and `env` added;
    a failure raises with the run's output."""
    command = [sys.executable, *stage] if launch is None else [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(RECIPES / f"{launch}.yaml"), *stage]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, WANDB_MODE="disabled", **env))
    if result.returncode != 0:
        raise RuntimeError(f"{label}: exit {result.returncode}\n{result.stdout[-3000:]}"
                           f"\n{result.stderr[-3000:]}")


def measure(case: PlanCase, checkpoint: Path, folder: Path) -> dict[str, float]:
    """Run `case` to the end; its summary's {"plan_gib", "peak_gib"}."""
    out_dir = folder / case.label.replace(" ", "_").replace(",", "").replace("×", "x")
    recipe = out_dir.with_suffix(".yaml")
    recipe.write_text(yaml.safe_dump(sft_recipe(case, checkpoint, out_dir)))
    run_stage(case.label, ["-m", "lathe.posttrain.sft", "--config", str(recipe)], case.launch,
              900, MALLOC_MMAP_THRESHOLD_="131072")
    return json.loads((out_dir / "summary.json").read_text())["memory"]


def plan_rows(folder: Path, cases: list[PlanCase] = CASES) -> list[str]:
    """One markdown row per case: plan, measured peak, their ratio."""
    checkpoint = plan_checkpoint(folder)
    rows = []
    for case in cases:
        memory = measure(case, checkpoint, folder)
        rows.append(f"| {case.label} | {memory['plan_gib']:.3f} | {memory['peak_gib']:.3f} | "
                    f"{memory['plan_gib'] / memory['peak_gib']:.2f} |")
        print(rows[-1], flush=True)
    return rows
