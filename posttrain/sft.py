"""Supervised fine-tuning (`lathe sft` / `accelerate launch -m lathe.posttrain.sft`):
teach the chat format by next-token loss on assistant tokens only.

Read top to bottom: config -> runtime -> policy (± LoRA) -> tokenized chats (assistant
mask from the chat template) -> loop (padded micro-batches, held-out assistant loss and
task accuracy by generation) -> export (LoRA merged) -> summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn

from lathe.model.checkpoint import read_model_config
from lathe.model.config import ModelConfig
from lathe.model.transformer import IGNORE_INDEX, routing_metrics
from lathe.posttrain.chats import (
    Example,
    chat_shape,
    chat_work,
    collate,
    sources_line,
    start_chat_run,
)
from lathe.posttrain.common import (
    TaskEvaluator,
    evaluate_task,
    finish_stage,
    load_policy,
    percent,
    rank_batches,
    real_tokens,
    stage_history,
    stage_main,
    stop_reached,
    train_on_batches,
)
from lathe.posttrain.config import SFTConfig
from lathe.posttrain.tool_episodes import EpisodeRunner
from lathe.pretrain.runtime.memory_plan import Parallelism, StepShape
from lathe.pretrain.runtime.trainer import Runtime


def sft_loss(model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean cross-entropy over the micro-batch's assistant tokens (padded or packed), plus a
    mixture of experts' router losses over its real tokens (logged with its loads)."""
    out = model(batch["ids"], labels=batch["labels"], return_logits=False,  # fused on CUDA
                documents=batch.get("documents"), token_mask=real_tokens(batch))
    return out.loss, {"loss": out.loss, **routing_metrics(out.router)}


@torch.no_grad()
def heldout_loss(runtime: Runtime, examples: list[Example], micro_batch: int,
                 pad_token: int) -> float:
    """Token-weighted assistant loss on held-out chats, reduced over ranks (collective)."""
    model = runtime.model
    model.eval()
    total = torch.zeros(2, device=runtime.device)
    for rows, counts in rank_batches(examples, micro_batch, runtime.rank, runtime.world_size):
        batch = collate(rows, pad_token, runtime.device)
        tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum() * counts
        loss = model(batch["ids"], labels=batch["labels"]).loss
        total += torch.stack([loss.float() * tokens, tokens.float()])
    model.train()
    total = runtime.accelerator.reduce(total, reduction="sum")
    return float(total[0] / total[1])


def step_shape(config: SFTConfig, parallelism: Parallelism,
               model_config: ModelConfig | None = None) -> StepShape:
    """One SFT micro-batch, for memory plans."""
    return chat_shape(config, model_config or read_model_config(config.model), parallelism)


def sft(config: SFTConfig, resume: str = "never") -> dict[str, Any]:
    runtime = Runtime(config, stage="sft")
    model, encoder = load_policy(runtime, config)
    model_config = model.config
    run = start_chat_run(runtime, config, model, encoder, resume,
                         step_shape(config, runtime.parallelism, model_config))
    evaluator = TaskEvaluator(config.task_eval, config.model, encoder,
                              EpisodeRunner(encoder, config.tools))
    runtime.print(f"sft: {len(run.train):,} chats ({run.mean_len:.0f} tokens on average), "
                  f"{len(run.heldout)} held out; {runtime.total_steps} steps on "
                  f"{runtime.setup['device']}"
                  + (f"; LoRA r={config.lora.r}" if config.lora.enabled else ""))

    history = stage_history(run.restored, "heldout_loss", "accuracy")

    def evaluate() -> bool:
        loss = heldout_loss(runtime, run.heldout, config.micro_batch_size, run.pad_token)
        accuracy = evaluate_task(runtime, evaluator, config.lora)
        runtime.log({"eval/heldout_loss": loss})
        history["heldout_loss"].append(loss)
        history["accuracy"].append(accuracy)
        runtime.print(f"step {runtime.step}: held-out assistant loss {loss:.4f}, "
                      f"{config.task_eval.task} accuracy {percent(accuracy)}")
        return stop_reached(runtime, config.task_eval, accuracy)

    if run.restored is None:
        evaluate()
    train_on_batches(runtime, config, run.batches, run.collate, sft_loss,
                     chat_work(model_config), evaluate, history)

    summary = finish_stage(runtime, config, model_config, history, ["heldout_loss", "accuracy"],
                           {"data_fit": asdict(run.fit), "sources": run.contributed()})
    if runtime.is_main:
        print(f"done: sft {runtime.step} steps in {summary['seconds']:.0f}s; held-out assistant "
              f"loss {history['heldout_loss'][0]:.4f} -> {history['heldout_loss'][-1]:.4f}, "
              f"accuracy {percent(history['accuracy'][0])} -> {percent(history['accuracy'][-1])}"
              + sources_line(summary["sources"]) + f"\ncheckpoint: {summary['final']}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("sft", "Supervised fine-tuning on chats (assistant tokens only).",
                      SFTConfig, sft, argv)


if __name__ == "__main__":
    import sys

    from lathe.core.cli import exit_process, run_command
    exit_process(run_command("sft", sys.argv[1:]))
