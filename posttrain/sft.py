"""Supervised fine-tuning (`lathe sft` / `accelerate launch -m lathe.posttrain.sft`):
teach the chat format by next-token loss on assistant tokens only.

Read top to bottom: config -> runtime -> policy (± LoRA) -> tokenized chats (assistant
mask from the chat template) -> loop (padded micro-batches, held-out assistant loss and
task accuracy by generation) -> export (LoRA merged) -> summary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from lathe.data.chat import Message, tokenize_chat
from lathe.data.formats import load_chat_dataset
from lathe.model.recipe import ConfigError
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.common import (
    ShuffledBatches,
    TaskEvaluator,
    evaluate_task,
    finish_stage,
    label_count,
    load_policy,
    pad,
    pad_id,
    rank_batches,
    sequence_work,
    stage_main,
    train_on_batches,
)
from lathe.posttrain.config import SFTConfig
from lathe.pretrain.runtime import Runtime, Work

Example = tuple[list[int], list[int]]  # input ids, labels (-100 outside assistant spans)


@dataclass
class ChatFit:
    """How a chat dataset fits `max_len`: chats kept whole, cut at max_len (their tail loses
    supervision), and dropped because nothing assistant-written was left after the cut."""

    whole: int = 0
    cut: int = 0
    dropped: int = 0

    def report(self) -> str:
        return (f"chats over max_len: {self.cut} cut, {self.dropped} dropped (no assistant "
                f"token left), {self.whole} whole")


def tokenize(tokenizer: Tokenizer, chats: list[list[Message]], max_len: int,
             fit: ChatFit | None = None) -> list[Example]:
    fit = fit if fit is not None else ChatFit()
    examples = []
    for messages in chats:
        ids, mask = tokenize_chat(tokenizer, messages)
        if len(ids) > max_len:
            ids, mask = ids[:max_len], mask[:max_len]
            fit.cut += 1
        else:
            fit.whole += 1
        if any(mask[1:]):  # something left to learn after truncation
            examples.append((ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask,
                                                                            strict=True)]))
        else:
            fit.dropped += 1
    return examples


def collate(examples: list[Example], pad_token: int, device: torch.device) -> dict[str, Any]:
    return {"ids": pad([e[0] for e in examples], pad_token).to(device),
            "labels": pad([e[1] for e in examples], IGNORE_INDEX).to(device),
            "lengths": [len(e[0]) for e in examples]}


def sft_loss(model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean cross-entropy over the micro-batch's assistant tokens."""
    loss = model(batch["ids"], labels=batch["labels"], return_logits=False).loss  # fused on CUDA
    return loss, {"loss": loss}


def chat_work(model_config: Any) -> Callable[[dict[str, Any]], Work]:
    """SFT and distillation losses are means over assistant tokens."""
    return lambda batch: sequence_work(model_config, batch["lengths"],
                                       label_count(batch["labels"]))


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


@dataclass
class ChatRun:
    """A chat-trained run, started: its examples, their batch order and mean length, and
    the state restored on resume (None on a fresh start)."""

    train: list[Example]
    heldout: list[Example]
    batches: ShuffledBatches
    mean_len: float
    fit: ChatFit
    restored: dict[str, Any] | None


def start_chat_run(runtime: Runtime, config: Any, model: nn.Module, tokenizer: Tokenizer,
                   resume: str) -> ChatRun:
    """Tokenize `config.data`'s training and held-out chats, size the run from their mean
    length, prepare the runtime, and on resume restore the batch order (SFT, distillation)."""
    model_config, data = model.config, config.data
    if data.max_len > model_config.max_seq_len:
        raise ConfigError(f"data.max_len={data.max_len} exceeds the model's max_seq_len="
                          f"{model_config.max_seq_len}; lower data.max_len")
    fit = ChatFit()
    train = tokenize(tokenizer, load_chat_dataset(data.train, "train", data.limit), data.max_len,
                     fit)
    if not train:
        raise ConfigError(f"data.train={data.train!r}: no chat has an assistant token within "
                          f"data.max_len={data.max_len}; raise data.max_len")
    heldout = tokenize(tokenizer, load_chat_dataset(data.eval or data.train, "test",
                                                    config.eval.batches * config.micro_batch_size),
                       data.max_len)
    batches = ShuffledBatches(train, config.micro_batch_size, config.seed, runtime.rank,
                              runtime.world_size)
    mean_len = sum(len(e[0]) for e in train) / len(train)
    tokens_per_step = int(config.micro_batch_size * config.grad_accum_steps
                          * runtime.world_size * mean_len)
    total_steps = config.total_steps(tokens_per_step, model_config.num_params())
    runtime.prepare(model, total_steps)
    restored = runtime.start(config, resume)
    if restored is not None:
        batches.load_state_dict(restored["batches"])
    runtime.print(fit.report())
    return ChatRun(train, heldout, batches, mean_len, fit, restored)


def sft(config: SFTConfig, resume: str = "never") -> dict[str, Any]:
    runtime = Runtime(config, stage="sft")
    model, tokenizer = load_policy(runtime, config.model, config.lora)
    model_config = model.config
    run = start_chat_run(runtime, config, model, tokenizer, resume)
    evaluator = TaskEvaluator(config.task_eval, config.model, tokenizer)
    runtime.print(f"sft: {len(run.train):,} chats ({run.mean_len:.0f} tokens on average), "
                  f"{len(run.heldout)} held out; {runtime.total_steps} steps on "
                  f"{runtime.setup['device']}"
                  + (f"; LoRA r={config.lora.r}" if config.lora.enabled else ""))

    pad_token = pad_id(tokenizer)
    history: dict[str, list[float]] = {"heldout_loss": [], "accuracy": []}

    def evaluate() -> None:
        loss = heldout_loss(runtime, run.heldout, config.micro_batch_size, pad_token)
        accuracy = evaluate_task(runtime, evaluator, config.lora)
        runtime.log({"eval/heldout_loss": loss})
        history["heldout_loss"].append(loss)
        history["accuracy"].append(accuracy)
        runtime.print(f"step {runtime.step}: held-out assistant loss {loss:.4f}, "
                      f"{config.task_eval.task} accuracy {accuracy:.1%}")

    if run.restored is None:
        evaluate()
    train_on_batches(runtime, config, run.batches,
                     lambda rows: collate(rows, pad_token, runtime.device), sft_loss,
                     chat_work(model_config), evaluate)

    summary = finish_stage(runtime, config, model_config, history, ["heldout_loss", "accuracy"],
                           {"data_fit": asdict(run.fit)})
    if runtime.is_main:
        print(f"done: sft {runtime.step} steps in {summary['seconds']:.0f}s; held-out assistant "
              f"loss {history['heldout_loss'][0]:.4f} -> {history['heldout_loss'][-1]:.4f}, "
              f"accuracy {history['accuracy'][0]:.1%} -> {history['accuracy'][-1]:.1%}\n"
              f"checkpoint: {summary['final']}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("sft", "Supervised fine-tuning on chats (assistant tokens only).",
                      SFTConfig, sft, argv)


if __name__ == "__main__":
    import sys

    from lathe.model.cli import run_command
    sys.exit(run_command("sft", sys.argv[1:]))
