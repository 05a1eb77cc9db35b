"""Group relative policy optimization with verifiable rewards (`lathe grpo` /
`accelerate launch -m lathe.posttrain.grpo`).

Read top to bottom: config -> runtime -> policy (± LoRA), optional reference (only when
beta > 0) -> the serve engine on a copy of the policy -> loop: sample prompts, generate G
completions each with the engine (batched, paged KV), score them with the reward
functions, turn scores into group-relative advantages, take `updates_per_batch` optimizer
steps of the clipped surrogate (token-level normalization, optional k3 KL), refresh the
engine's weights from the policy -> held-out accuracy -> export -> summary.

Rollouts are generated on the main process and broadcast, so every launch (DDP, FSDP2,
ZeRO) sees the same batch; each rank trains on its share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from torch import Tensor, nn

from lathe.data.formats import PromptRow, load_prompt_dataset
from lathe.model.checkpoint import load_checkpoint
from lathe.model.lora import adapters_disabled, merge_lora
from lathe.model.recipe import ConfigError
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.common import (
    ShuffledBatches,
    TaskEvaluator,
    eos_ids,
    evaluate_task,
    finish_stage,
    generation_model,
    load_policy,
    pad,
    pad_id,
    stage_main,
)
from lathe.posttrain.config import GRPOConfig
from lathe.posttrain.rewards import load_reward, verifier
from lathe.pretrain.runtime import Runtime, plain_model
from lathe.serve.chat_template import ChatTemplate
from lathe.serve.engine import EngineConfig, LLMEngine
from lathe.serve.sampling import SamplingParams


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float
    correct: float
    advantage: float = 0.0


def group_advantages(rewards: Tensor, kind: str = "grpo", eps: float = 1e-4) -> Tensor:
    """(P, G) rewards -> advantages: minus the group mean, divided by the group std for
    GRPO (population std, as TRL) and not for Dr.GRPO."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if kind == "dr_grpo":
        return centred
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)


def clipped_surrogate(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor,
                      epsilon: float, epsilon_high: float | None = None,
                      ref_logps: Tensor | None = None,
                      beta: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-style clipped objective per token, averaged over all completion tokens.

    logps/old_logps/ref_logps/mask: (N, T); advantages: (N,). The ratio is clipped to
    [1 − ε, 1 + ε_high] (ε_high = ε unless DAPO's clip-higher is set); with beta > 0 the
    k3 estimator exp(ref − π) − (ref − π) − 1 of KL(π‖ref) is added per token.
    """
    mask = mask.float()
    ratio = torch.exp(logps - old_logps)
    high = epsilon if epsilon_high is None else epsilon_high
    advantages = advantages[:, None]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high) * advantages
    per_token = -torch.min(unclipped, clipped)
    tokens = mask.sum().clamp(min=1)
    metrics: dict[str, Tensor] = {
        "clip_fraction": (((ratio < 1 - epsilon) & (advantages < 0))
                          | ((ratio > 1 + high) & (advantages > 0))).float().mul(mask).sum()
        / tokens}
    if ref_logps is not None and beta > 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
        metrics["kl"] = (kl * mask).sum() / tokens
    loss = (per_token * mask).sum() / tokens
    metrics["loss"] = loss
    return loss, metrics


def per_token_logps(model: nn.Module, ids: Tensor, labels: Tensor) -> Tensor:
    """log p(label_t | tokens < t) per position of the (N, T) batch (0 where unlabelled)."""
    logits = model(ids).logits[:, :-1].float()
    targets = labels[:, 1:]
    logps = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return logps * (targets != IGNORE_INDEX)


def collate(rollouts: list[Rollout], pad_token: int, device: torch.device) -> dict[str, Tensor]:
    ids = pad([r.prompt_ids + r.completion_ids for r in rollouts], pad_token).to(device)
    labels = pad([[IGNORE_INDEX] * len(r.prompt_ids) + r.completion_ids for r in rollouts],
                 IGNORE_INDEX).to(device)
    return {"ids": ids, "labels": labels, "mask": labels[:, 1:] != IGNORE_INDEX,
            "advantages": torch.tensor([r.advantage for r in rollouts], device=device)}


class RolloutGenerator:
    """The serve engine on its own copy of the policy: G samples per prompt, scored."""

    def __init__(self, config: GRPOConfig, tokenizer: Any, model: nn.Module,
                 kv_dtype: torch.dtype) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.template = ChatTemplate.from_checkpoint(config.model)
        self.rewards = [(load_reward(r.name), r.weight) for r in config.rewards]
        self.correct = verifier(config.task_eval.task)
        self.engine = LLMEngine(model.eval(), tokenizer, EngineConfig(num_blocks=1024),
                                eos_ids(config.model), kv_dtype=kv_dtype)

    def refresh(self, state: dict[str, Tensor]) -> None:
        self.engine.load_weights(state)

    def __call__(self, rows: list[PromptRow], seed: int) -> list[Rollout]:
        c = self.config
        prompts = [self.tokenizer.encode(self.template.render(row.prompt),
                                         add_special_tokens=False).ids for row in rows]
        params = [SamplingParams(max_tokens=c.max_completion_tokens, temperature=c.temperature,
                                 top_p=c.top_p, n=c.num_generations, seed=seed + i * 1000)
                  for i in range(len(rows))]
        rollouts = []
        for row, prompt, done in zip(rows, prompts, self.engine.generate(prompts, params),
                                     strict=True):
            for out in done.outputs:
                reward = sum(w * fn(out.text, row.reference) for fn, w in self.rewards)
                rollouts.append(Rollout(prompt, out.token_ids, reward,
                                        self.correct(out.text, row.reference)))
        return rollouts


def engine_state(runtime: Runtime, config: GRPOConfig) -> dict[str, Tensor] | None:
    """The policy's full weights, adapters merged, on the main process (collective)."""
    model = generation_model(runtime, config.lora)
    if model is None:
        return None
    if config.lora.enabled:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model = merge_lora(plain_model(model.config, state, lora=config.lora))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def grpo(config: GRPOConfig, resume: str = "never") -> dict[str, Any]:
    runtime = Runtime(config, stage="grpo")
    if config.prompts_per_step % runtime.world_size:
        raise ConfigError(f"prompts_per_step={config.prompts_per_step} must be divisible by the "
                          f"{runtime.world_size} processes")
    rollouts_per_rank = config.prompts_per_step * config.num_generations // runtime.world_size
    if rollouts_per_rank % config.grad_accum_steps:
        raise ConfigError(f"each rank's {rollouts_per_rank} rollouts must split evenly into "
                          f"grad_accum_steps={config.grad_accum_steps} micro-batches")
    model, tokenizer = load_policy(config.model, config.lora)
    model_config = model.config
    reference = None
    if config.beta > 0 and not config.lora.enabled:
        reference = load_checkpoint(config.model, dtype=torch.float32, device=runtime.device)
    prompts = load_prompt_dataset(config.prompts, "train", config.limit)
    sampler = ShuffledBatches(prompts, config.prompts_per_step, config.seed)
    iterations = config.total_steps(1, model_config.num_params())
    total_steps = iterations
    runtime.prepare(model, total_steps, model_config.flops_per_token(64))
    restored = runtime.start(config, resume)
    if restored is not None:
        sampler.load_state_dict(restored["prompts"])
    generator = None
    if runtime.is_main:
        generator = RolloutGenerator(config, tokenizer, load_checkpoint(
            config.model, dtype=torch.float32, device=runtime.device), runtime.compute_dtype)
    state = engine_state(runtime, config)
    if generator is not None:
        generator.refresh(state)
    evaluator = TaskEvaluator(config.task_eval, config.model, tokenizer)
    pad_token = pad_id(tokenizer)
    runtime.print(f"grpo: {len(prompts):,} prompts, {config.prompts_per_step} × "
                  f"{config.num_generations} rollouts per batch, {config.updates_per_batch} "
                  f"update(s) each, {total_steps} optimizer steps, advantages "
                  f"{config.advantage}, beta {config.beta}")

    def loss_fn(m: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        logps = per_token_logps(m, batch["ids"], batch["labels"])
        return clipped_surrogate(logps, batch["old"], batch["advantages"], batch["mask"],
                                 config.epsilon, config.epsilon_high, batch.get("ref"),
                                 config.beta)

    history: dict[str, list[float]] = {"reward": [], "accuracy": [], "heldout_accuracy": []}
    if restored is None:
        history["heldout_accuracy"].append(evaluate_task(runtime, evaluator, config.lora))
    while runtime.step < total_steps:
        rows = sampler.next()
        with runtime.autocast():
            batch = [generator(rows, seed=config.seed * 7919 + runtime.step * 104729)
                     if generator is not None else None]
        broadcast_object_list(batch)
        rollouts: list[Rollout] = batch[0]
        rewards = torch.tensor([r.reward for r in rollouts]).view(len(rows), -1)
        for rollout, advantage in zip(rollouts, group_advantages(
                rewards, config.advantage).flatten().tolist(), strict=True):
            rollout.advantage = advantage
        mine = rollouts[runtime.rank * rollouts_per_rank:(runtime.rank + 1) * rollouts_per_rank]
        size = rollouts_per_rank // config.grad_accum_steps
        micro = [collate(mine[i:i + size], pad_token, runtime.device)
                 for i in range(0, rollouts_per_rank, size)]
        with runtime.autocast():
            attach_old_and_reference(runtime.model, reference, micro, config.lora.enabled
                                     and config.beta > 0)
        tokens = sum(int(m["mask"].sum()) for m in micro) * runtime.world_size
        rollout_metrics = {
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "train/accuracy": sum(r.correct for r in rollouts) / len(rollouts),
            "completion/mean_length": sum(len(r.completion_ids) for r in rollouts)
            / len(rollouts),
        }
        for _ in range(config.updates_per_batch):
            if runtime.step >= total_steps:
                break
            result = runtime.train_step(micro, loss_fn, tokens)
            result.metrics.update({k: torch.tensor(v) for k, v in rollout_metrics.items()})
            runtime.log_step(result)
        history["reward"].append(rollout_metrics["reward/mean"])
        history["accuracy"].append(rollout_metrics["train/accuracy"])
        state = engine_state(runtime, config)
        if generator is not None:
            generator.refresh(state)
        if runtime.should(config.eval.every):
            accuracy = evaluate_task(runtime, evaluator, config.lora)
            history["heldout_accuracy"].append(accuracy)
            runtime.print(f"step {runtime.step}: reward {rollout_metrics['reward/mean']:.3f}, "
                          f"rollout accuracy {rollout_metrics['train/accuracy']:.1%}, "
                          f"held-out accuracy {accuracy:.1%}")
        if runtime.should(config.checkpoint.every):
            runtime.save({"prompts": sampler.state_dict()})

    summary = finish_stage(runtime, config, model_config, history, ["reward", "heldout_accuracy"])
    if runtime.is_main:
        first, last = history["reward"][:5], history["reward"][-5:]
        print(f"done: grpo {runtime.step} steps in {summary['seconds']:.0f}s; mean reward "
              f"{sum(first) / len(first):.3f} (first 5 batches) -> {sum(last) / len(last):.3f} "
              f"(last 5), held-out accuracy {history['heldout_accuracy'][0]:.1%} -> "
              f"{history['heldout_accuracy'][-1]:.1%}\ncheckpoint: {summary['final']}")
    return summary


@torch.no_grad()
def attach_old_and_reference(model: nn.Module, reference: nn.Module | None,
                             micro: list[dict[str, Tensor]], lora_reference: bool) -> None:
    """Log-probs of the rollout policy (before this batch's updates) and of the reference."""
    model.eval()
    for batch in micro:
        batch["old"] = per_token_logps(model, batch["ids"], batch["labels"])
        if reference is not None:
            batch["ref"] = per_token_logps(reference, batch["ids"], batch["labels"])
        elif lora_reference:
            with adapters_disabled(model):
                batch["ref"] = per_token_logps(model, batch["ids"], batch["labels"])
    model.train()


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("grpo", "GRPO with verifiable rewards; rollouts from the serve engine.",
                      GRPOConfig, grpo, argv)


if __name__ == "__main__":
    import sys

    from lathe.model.cli import run_command
    sys.exit(run_command("grpo", sys.argv[1:]))
