"""Reward modelling (`lathe rm` / `accelerate launch -m lathe.posttrain.reward_model`): a
sequence classifier of one label — the starting checkpoint's decoder with a score head,
HF's `…ForSequenceClassification` — trained on (prompt, chosen, rejected) pairs with the
Bradley–Terry loss as TRL's RewardTrainer computes it: −log σ(r_chosen − r_rejected − m),
m a pair's `margin` when the data gives one, plus `center_rewards_coefficient` · mean
(r_chosen + r_rejected)². A reward is the score at a conversation's last token (as
transformers reads it: the last that is not the pad token). The export loads in
transformers as the family's sequence classifier; GRPO takes it as a reward
(`rewards: [{model: PATH}]`, `RewardModelScorer`). With `lora.enabled` the decoder trains
through adapters and the score head whole (TRL's `modules_to_save=["score"]`); the export
merges them, so out_dir/final is the whole reward model (the adapter folder beside it holds
the decoder's adapters alone).

Read top to bottom: config -> runtime -> the classifier -> pairs rendered through the chat
template and fitted (DPO's) -> loop: a micro-batch's chosen and rejected rows in one
forward, the loss, held-out preference accuracy on its cadence -> export -> summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder, chat_encoder
from lathe.data.formats import Message, Tools, load_preference_dataset
from lathe.model.checkpoint import OpenCheckpoint
from lathe.model.config import ModelConfig
from lathe.model.lora import apply_lora
from lathe.posttrain import dpo
from lathe.posttrain.common import (
    PromptFit,
    ShuffledBatches,
    finish_stage,
    pad,
    pad_id,
    sequence_work,
    stage_history,
    stage_main,
    stage_model,
    train_on_batches,
)
from lathe.posttrain.config import RMConfig
from lathe.posttrain.dpo import Pair, collate_sides, heldout_preference, tokenize_pairs
from lathe.pretrain.runtime.memory_plan import Parallelism, StepShape
from lathe.pretrain.runtime.trainer import Runtime


def last_token_scores(model: nn.Module, ids: Tensor, lengths: Sequence[int]) -> Tensor:
    """Each row's first score at its last token (rows right-padded to (N, T)): (N,)."""
    scores = model(ids).logits[..., 0]
    last = torch.tensor(lengths, device=ids.device) - 1
    return scores[torch.arange(len(lengths), device=ids.device), last].float()


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None,
                       center: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """TRL's RewardTrainer loss on (N,) rewards of the chosen and rejected replies, with its
    metrics: the share of pairs ranked right and the mean reward margin."""
    difference = chosen - rejected
    loss = -F.logsigmoid(difference - (margin if margin is not None else 0.0)).mean()
    if center is not None:
        loss = loss + center * ((chosen + rejected) ** 2).mean()
    return loss, {"loss": loss, "rewards/accuracy": (difference > 0).float().mean(),
                  "rewards/margins": difference.mean().detach()}


def collate(pairs: list[Pair], pad_token: int, device: torch.device) -> dict[str, Any]:
    """DPO's chosen-then-rejected rows, and each pair's margin."""
    return collate_sides(pairs, pad_token, device) | {
        "margin": torch.tensor([p.margin for p in pairs], device=device)}


def step_shape(config: RMConfig, parallelism: Parallelism,
               model_config: ModelConfig | None = None) -> StepShape:
    """One micro-batch, for memory plans: DPO's pair of rows, through the score head."""
    return dpo.step_shape(config, parallelism, model_config, head="score")


def reward_model(config: RMConfig, resume: str = "never") -> dict[str, Any]:
    runtime = Runtime(config, stage="rm")
    encoder = chat_encoder(config.model, config.chat_template, config.chat_template_kwargs)
    model = stage_model(runtime, OpenCheckpoint(config.model), num_labels=1).train()
    if config.lora.enabled:  # adapters on the decoder; the new score head trains whole (TRL's
        apply_lora(model, config.lora)  # modules_to_save=["score"])
        model.score.requires_grad_(True)
    model_config, data, pad_token = model.config, config.data, pad_id(encoder.tokenizer)
    fit = dpo.preference_fit(data, model_config.max_seq_len)
    train = tokenize_pairs(encoder, load_preference_dataset(data.train, "train", data.limit),
                           data.max_len, fit)
    dpo.require_examples(train, data, fit)
    heldout = tokenize_pairs(encoder, load_preference_dataset(
        data.eval or data.train, "test", config.eval.batches * config.micro_batch_size),
        data.max_len, PromptFit(fit.max_prompt_length, fit.overflow))
    batches = ShuffledBatches(train, config.micro_batch_size, config.seed, runtime.rank,
                              runtime.world_size)
    mean_len = sum(len(p.chosen[0]) + len(p.rejected[0]) for p in train) / len(train)
    total_steps = config.total_steps(int(config.micro_batch_size * config.grad_accum_steps
                                         * runtime.world_size * mean_len),
                                     model_config.num_params())
    runtime.prepare(model, total_steps, step_shape(config, runtime.parallelism, model_config))
    restored = runtime.start(config, resume)
    if restored is not None:
        batches.load_state_dict(restored["batches"])
    runtime.print(f"rm: {len(train):,} pairs, {len(heldout)} held out, {total_steps} steps, "
                  f"center_rewards_coefficient {config.center_rewards_coefficient}; "
                  f"{encoder.name}; {fit.report()}")

    def loss_fn(m: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        rewards = last_token_scores(m, batch["ids"], batch["lengths"])
        chosen, rejected = rewards.chunk(2)
        return bradley_terry_loss(chosen, rejected, batch["margin"],
                                  config.center_rewards_coefficient)

    def collated(rows: list[Pair]) -> dict[str, Any]:
        return collate(rows, pad_token, runtime.device)

    history = stage_history(restored, "preference_accuracy")

    def evaluate() -> bool:
        with torch.no_grad():
            metrics = heldout_preference(runtime, heldout, config.micro_batch_size, collated,
                                         loss_fn)
        runtime.log(metrics)
        history["preference_accuracy"].append(metrics["eval/preference_accuracy"])
        runtime.print(f"step {runtime.step}: held-out preference accuracy "
                      f"{metrics['eval/preference_accuracy']:.1%} (loss "
                      f"{metrics['eval/preference_loss']:.4f})")
        return False

    if restored is None:
        evaluate()
    train_on_batches(runtime, config, batches, collated, loss_fn,
                     lambda batch: sequence_work(model_config, batch["lengths"],
                                                 len(batch["lengths"]) // 2),
                     evaluate, history)
    summary = finish_stage(runtime, config, model_config, history, ["preference_accuracy"],
                           {"prompt_fit": fit.counts()})
    if runtime.is_main:
        accuracy = history["preference_accuracy"]
        print(f"done: rm {runtime.step} steps in {summary['seconds']:.0f}s; held-out "
              f"preference accuracy {accuracy[0]:.1%} -> {accuracy[-1]:.1%}\n"
              f"checkpoint: {summary['final']}")
    return summary


class RewardModelScorer:
    """A reward model as a GRPO reward: each episode's conversation rendered through the
    reward model's own chat template, scored in batches at its last token (the engine's
    weights are not involved: the classifier runs beside them, frozen)."""

    def __init__(self, path: str | Path, device: torch.device, batch_size: int = 16) -> None:
        opened = OpenCheckpoint(path)
        if not opened.config.num_labels:
            raise ConfigError(f"rewards: model={str(path)!r} is a language model, not a reward "
                              "model (a sequence classifier: train one with lathe rm)")
        self.model = opened.model(dtype=torch.float32, device=device).requires_grad_(False)
        self.encoder: ChatEncoder = chat_encoder(path)
        self.pad_token, self.device, self.batch_size = pad_id(
            self.encoder.tokenizer), device, batch_size
        self.max_len = opened.config.max_seq_len

    @torch.no_grad()
    def __call__(self, conversations: list[list[Message]],
                 tools: list[Tools] | None = None) -> list[float]:
        rows = [self.encoder.encode(self.encoder.render(messages, (tools or [None] * len(
            conversations))[i], add_generation_prompt=False))[-self.max_len:]
            for i, messages in enumerate(conversations)]
        scores: list[float] = []
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start:start + self.batch_size]
            ids = pad(chunk, self.pad_token).to(self.device)
            scores += last_token_scores(self.model, ids, [len(r) for r in chunk]).tolist()
        return scores


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("rm", "Train a reward model (a sequence classifier) on (prompt, chosen, "
                      "rejected) pairs: Bradley-Terry, as TRL's RewardTrainer.", RMConfig,
                      reward_model, argv)


if __name__ == "__main__":
    import sys

    from lathe.core.cli import exit_process, run_command
    exit_process(run_command("rm", sys.argv[1:]))
