"""Chats as training examples, for the stages that train on them (SFT, logit distillation):
read from one source or a weighted mixture, tokenized through the stage's chat template
with its assistant mask and fitted to max_len, collated into padded batches or packed
rows (`data.packing`), the work each batch holds, and a chat run started on the runtime."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder
from lathe.data.formats import Chat, load_chat_dataset
from lathe.data.mixture import load_rows
from lathe.model.config import ModelConfig
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.common import (
    ShuffledBatches,
    evaluation_cache_bytes,
    label_count,
    pad,
    pad_id,
    sequence_work,
)
from lathe.posttrain.config import ChatStageConfig
from lathe.posttrain.packing import best_fit_decreasing, collate_packed
from lathe.pretrain.runtime.memory_plan import Parallelism, StepShape
from lathe.pretrain.runtime.trainer import Runtime, Work


class Example(NamedTuple):
    ids: list[int]
    labels: list[int]  # -100 outside assistant spans
    source: int = 0  # which source of the mixture it came from


@dataclass
class ChatFit:
    """How a chat dataset fits `max_len`: chats kept whole, cut at max_len (their tail loses
    supervision), and dropped because nothing assistant-written was left after the cut; and
    the chats whose system prompt the template leaves out of their tokens."""

    whole: int = 0
    cut: int = 0
    dropped: int = 0
    system_dropped: int = 0

    def report(self) -> str:
        line = (f"chats over max_len: {self.cut} cut, {self.dropped} dropped (no assistant "
                f"token left), {self.whole} whole")
        if self.system_dropped:
            line += (f"; {self.system_dropped} chats' system prompts are not in their tokens "
                     "(the chat template writes one only where a conversation ends on a user "
                     "turn, as Mistral's do; transformers renders them so too)")
        return line


def tokenize(encoder: ChatEncoder, chats: list[Chat], max_len: int,
             fit: ChatFit | None = None, sources: list[int] | None = None) -> list[Example]:
    fit = fit if fit is not None else ChatFit()
    examples = []
    for index, chat in enumerate(chats):
        ids, mask = encoder.conversation(chat)
        fit.system_dropped += encoder.drops_system(chat)
        if len(ids) > max_len:
            ids, mask = ids[:max_len], mask[:max_len]
            fit.cut += 1
        else:
            fit.whole += 1
        if any(mask[1:]):  # something left to learn after truncation
            labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]
            examples.append(Example(ids, labels, sources[index] if sources else 0))
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


def source_tokens(examples: list[Example], names: list[str]) -> dict[str, dict[str, int]]:
    """Per source: the examples, tokens and assistant (trained) tokens in `examples`."""
    tally = {name: {"examples": 0, "tokens": 0, "assistant_tokens": 0} for name in names}
    for example in examples:
        entry = tally[names[example.source]]
        entry["examples"] += 1
        entry["tokens"] += len(example.ids)
        entry["assistant_tokens"] += sum(label != IGNORE_INDEX for label in example.labels[1:])
    return tally


def sources_line(tally: dict[str, dict[str, int]]) -> str:
    """The summary's word on what each source of a mixture gave (nothing for one source)."""
    if len(tally) < 2:
        return ""
    return "\ntrained on: " + ", ".join(f"{name} {entry['tokens']:,} tokens "
                                        f"({entry['examples']:,} chats)"
                                        for name, entry in tally.items())


@dataclass
class ChatRun:
    """A chat-trained run, started: its examples, their batch order (of examples, or of
    packed rows of them) and mean row length, the mixture's source names, and the state
    restored on resume (None on a fresh start)."""

    train: list[Example]
    heldout: list[Example]
    batches: ShuffledBatches
    mean_len: float
    fit: ChatFit
    restored: dict[str, Any] | None
    packed: bool
    pad_token: int
    device: torch.device
    sources: list[str]

    def collate(self, items: list) -> dict[str, Any]:
        """A micro-batch of what `batches` yields: padded examples or packed rows."""
        if self.packed:
            return collate_packed(items, self.pad_token, self.device)
        return collate(items, self.pad_token, self.device)

    def contributed(self) -> dict[str, dict[str, int]]:
        """What each source gave the steps taken so far (examples, tokens, assistant
        tokens), from the batch order alone: exact across resumes."""
        taken = self.batches.taken()
        if self.packed:
            taken = [example for row in taken for example in row]
        return source_tokens(taken, self.sources)


def assistant_tokens(examples: list[Example]) -> str:
    """Assistant (trained) tokens per example: mean, min and max, for the start banner."""
    counts = [sum(label != IGNORE_INDEX for label in e.labels[1:]) for e in examples]
    return (f"assistant tokens per chat: {sum(counts) / len(counts):.1f} on average "
            f"({min(counts)}..{max(counts)})")


def chat_shape(config: ChatStageConfig, model_config: ModelConfig, parallelism: Parallelism,
               frozen_bytes: int = 0) -> StepShape:
    """One micro-batch of a chat stage: rows of up to data.max_len tokens (padded to the
    longest, or packed full), mean cross-entropy; `frozen_bytes` a teacher's weights."""
    return StepShape(config.micro_batch_size, config.data.max_len, "loss",
                     config.grad_accum_steps, frozen_bytes, evaluation_bytes=
                     evaluation_cache_bytes(model_config, parallelism.mixed_precision),
                     packed=config.data.packing)


def start_chat_run(runtime: Runtime, config: ChatStageConfig, model: nn.Module,
                   encoder: ChatEncoder, resume: str, shape: StepShape) -> ChatRun:
    """Tokenize `config.data`'s training and held-out chats, size the run from their mean
    length, prepare the runtime (its memory plan for `shape`), and on resume restore the
    batch order (SFT, distillation)."""
    model_config, data = model.config, config.data
    if data.max_len > model_config.max_seq_len:
        raise ConfigError(f"data.max_len={data.max_len} exceeds the model's max_seq_len="
                          f"{model_config.max_seq_len}; lower data.max_len")
    fit = ChatFit()
    chats, mixture = load_rows(data.train, load_chat_dataset, "train", data.limit, config.seed)
    train = tokenize(encoder, chats, data.max_len, fit,
                     mixture.source_of if mixture is not None else None)
    if not train:
        raise ConfigError(f"data.train={data.train!r}: no chat has an assistant token within "
                          f"data.max_len={data.max_len}; raise data.max_len")
    heldout_chats, _ = load_rows(data.eval or data.train, load_chat_dataset, "test",
                                  config.eval.batches * config.micro_batch_size, config.seed)
    heldout = tokenize(encoder, heldout_chats, data.max_len)
    items: list = train
    if data.packing:
        items = [[train[i] for i in row]
                 for row in best_fit_decreasing([len(e.ids) for e in train], data.max_len)]
        if len(items) < config.micro_batch_size * runtime.world_size:
            raise ConfigError(f"data.packing=true: {len(train)} chats pack into {len(items)} "
                              f"rows of data.max_len={data.max_len}, fewer than one step of "
                              f"micro_batch_size={config.micro_batch_size} rows × "
                              f"{runtime.world_size} ranks; lower micro_batch_size (it counts "
                              "rows when packing) or add chats")
    batches = ShuffledBatches(items, config.micro_batch_size, config.seed, runtime.rank,
                              runtime.world_size)
    mean_len = sum(len(e.ids) for e in train) / len(items)
    tokens_per_step = int(config.micro_batch_size * config.grad_accum_steps
                          * runtime.world_size * mean_len)
    total_steps = config.total_steps(tokens_per_step, model_config.num_params())
    runtime.prepare(model, total_steps, shape)
    restored = runtime.start(config, resume)
    if restored is not None:
        batches.load_state_dict(restored["batches"])
    runtime.print(f"{encoder.name}; {assistant_tokens(train)}; {fit.report()}")
    names = mixture.names if mixture is not None else [str(data.train)]
    if mixture is not None:
        tally = source_tokens(train, names)
        runtime.print(mixture.report() + "; tokens: " + ", ".join(
            f"{name} {tally[name]['tokens']:,}" for name in names))
    if data.packing:
        runtime.print(f"packing: {len(train):,} chats into {len(items):,} rows of up to "
                      f"{data.max_len} tokens ({mean_len / data.max_len:.1%} full)")
    return ChatRun(train, heldout, batches, mean_len, fit, restored, data.packing,
                   pad_id(encoder.tokenizer), runtime.device, names)
