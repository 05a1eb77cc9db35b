"""Chats as training examples, for the stages that train on them (SFT, logit distillation):
tokenized through the stage's chat template with its assistant mask and fitted to max_len,
collated into padded batches, the work each batch holds, and a chat run started on the
runtime."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder
from lathe.data.formats import Chat, load_chat_dataset
from lathe.model.config import ModelConfig
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.common import ShuffledBatches, label_count, pad, sequence_work
from lathe.posttrain.config import ChatStageConfig
from lathe.pretrain.runtime.trainer import Runtime, Work

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


def tokenize(encoder: ChatEncoder, chats: list[Chat], max_len: int,
             fit: ChatFit | None = None) -> list[Example]:
    fit = fit if fit is not None else ChatFit()
    examples = []
    for chat in chats:
        ids, mask = encoder.conversation(chat)
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


def chat_work(model_config: ModelConfig) -> Callable[[dict[str, Any]], Work]:
    """SFT and distillation losses are means over assistant tokens."""
    return lambda batch: sequence_work(model_config, batch["lengths"],
                                       label_count(batch["labels"]))


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


def assistant_tokens(examples: list[Example]) -> str:
    """Assistant (trained) tokens per example: mean, min and max, for the start banner."""
    counts = [sum(label != IGNORE_INDEX for label in labels[1:]) for _, labels in examples]
    return (f"assistant tokens per chat: {sum(counts) / len(counts):.1f} on average "
            f"({min(counts)}..{max(counts)})")


def start_chat_run(runtime: Runtime, config: ChatStageConfig, model: nn.Module,
                   encoder: ChatEncoder,
                   resume: str) -> ChatRun:
    """Tokenize `config.data`'s training and held-out chats, size the run from their mean
    length, prepare the runtime, and on resume restore the batch order (SFT, distillation)."""
    model_config, data = model.config, config.data
    if data.max_len > model_config.max_seq_len:
        raise ConfigError(f"data.max_len={data.max_len} exceeds the model's max_seq_len="
                          f"{model_config.max_seq_len}; lower data.max_len")
    fit = ChatFit()
    train = tokenize(encoder, load_chat_dataset(data.train, "train", data.limit), data.max_len,
                     fit)
    if not train:
        raise ConfigError(f"data.train={data.train!r}: no chat has an assistant token within "
                          f"data.max_len={data.max_len}; raise data.max_len")
    heldout = tokenize(encoder, load_chat_dataset(data.eval or data.train, "test",
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
    runtime.print(f"{encoder.name}; {assistant_tokens(train)}; {fit.report()}")
    return ChatRun(train, heldout, batches, mean_len, fit, restored)
