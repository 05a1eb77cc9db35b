"""Group relative policy optimization with verifiable rewards (`lathe grpo` /
`accelerate launch -m lathe.posttrain.grpo`).

Read top to bottom: config -> runtime -> policy (± LoRA) -> prompts rendered and fitted to
max_prompt_length (so prompt + completion always fits the context) -> optional reference
(only when beta > 0; prepared like the policy, or under LoRA the policy with adapters off)
-> the serve engine on a copy of the policy -> loop: sample prompts, generate G completions
each with the engine (batched, paged KV), score them with the reward functions, turn
scores into group-relative advantages, take `updates_per_batch` optimizer steps of the
clipped surrogate on log-probs at the sampling temperature (normalized over the whole
step's completion tokens, or by Dr. GRPO's constant; optional k3 KL), refresh the
engine's weights from the policy's shards -> held-out accuracy -> export -> summary.
DAPO's dynamic sampling (groups whose rewards are all equal dropped, more prompts drawn)
and overlong handling (cut completions out of the loss, or a soft length penalty) are
switches of that loop.

Every rank generates its share of the step's prompts on its own engine (whole groups, so
advantages are per rank), each prompt seeded by its index in the step, so the rollouts are
the ones one process would sample; each rank trains on the rollouts it generated. Sharded
launches (FSDP2, ZeRO-3) gather the engine's weights on the main process and broadcast them.
With `rollout.url` the rollouts come from a server instead (lathe serve, or any that takes
POST /update_weights), every rank sending it its share; the main process pushes the policy's
weights to it after each step, and every rank waits for the push before sampling again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lathe.core.errors import ConfigError
from lathe.data.formats import load_prompt_dataset
from lathe.model.checkpoint import OpenCheckpoint, read_model_config
from lathe.model.config import ModelConfig
from lathe.model.lora import adapters_disabled
from lathe.model.transformer import RouterStats
from lathe.posttrain.common import (
    PromptFit,
    ShuffledBatches,
    TaskEvaluator,
    evaluate_task,
    evaluation_cache_bytes,
    finish_stage,
    labelled_logprobs,
    load_policy,
    pad_id,
    percent,
    sequence_work,
    stage_history,
    stage_main,
    stage_model,
    stop_reached,
    with_routing,
)
from lathe.posttrain.config import GRPOConfig
from lathe.posttrain.rollouts import (
    Rollout,
    RolloutGenerator,
    collate,
    engine_weights,
    fit_prompts,
    rollout_engine_bytes,
)
from lathe.posttrain.tool_episodes import EpisodeRunner
from lathe.pretrain.runtime.memory_plan import Parallelism, StepShape, frozen_weight_bytes
from lathe.pretrain.runtime.trainer import Runtime, Work
from lathe.serve.sampling_params import SamplingParams


def group_advantages(rewards: Tensor, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """(P, G) rewards -> advantages: minus the group mean, and divided by the group's
    sample standard deviation (Bessel-corrected, as TRL's `std`) when `scale`."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def clipped_surrogate(logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor,
                      epsilon: float, epsilon_high: float | None = None,
                      ref_logps: Tensor | None = None, beta: float = 0.0,
                      normalizer: float | None = None, sequence_level: bool = False,
                      kl_correction: bool = False,
                      sampling_weight: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-style clipped objective per token, summed over completion tokens and divided by
    `normalizer` (default: their count; Dr. GRPO: a constant), as TRL's GRPO computes it.

    logps/old_logps/ref_logps/mask: (N, T); advantages: (N,). The ratio — per token, or
    with `sequence_level` (GSPO) one per completion, the exp of its tokens' mean log-ratio —
    is clipped to [1 − ε, 1 + ε_high] (ε_high = ε unless DAPO's clip-higher is set); with
    beta > 0 the k3 estimator exp(ref − π) − (ref − π) − 1 of KL(π‖ref) is added per token,
    times the ratio with `kl_correction` (TRL's use_bias_correction_kl). `sampling_weight`
    ((N, T) or (N, 1), `sampling_weights`) multiplies the clipped term.
    """
    mask = mask.float()
    log_ratio = logps - old_logps
    if sequence_level:
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]
    ratio = torch.exp(log_ratio)
    high = epsilon if epsilon_high is None else epsilon_high
    advantages = advantages[:, None]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high) * advantages
    per_token = -torch.min(unclipped, clipped)
    if sampling_weight is not None:
        per_token = per_token * sampling_weight
    tokens = mask.sum().clamp(min=1)
    divisor = tokens if normalizer is None else normalizer
    metrics: dict[str, Tensor] = {
        "clip_fraction": (((ratio < 1 - epsilon) & (advantages < 0))
                          | ((ratio > 1 + high) & (advantages > 0))).float().mul(mask).sum()
        / divisor}
    if ref_logps is not None and beta > 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * (kl * ratio if kl_correction else kl)
        metrics["kl"] = (kl * mask).sum() / divisor
    loss = (per_token * mask).sum() / divisor
    metrics["loss"] = loss
    return loss, metrics


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (its eq. 13): 0 up to max_length − buffer tokens, then
    falling linearly to −1 at max_length, and −1 past it."""
    if length <= max_length - buffer:
        return 0.0
    if length <= max_length:
        return (max_length - buffer - length) / buffer
    return -1.0


def informative(group: list[Rollout]) -> bool:
    """Whether the group's rewards differ: an all-equal group has no advantage to learn from."""
    return max(r.reward for r in group) > min(r.reward for r in group)


def select_groups(groups: list[list[Rollout]], wanted: int) -> tuple[list[list[Rollout]], int]:
    """DAPO's dynamic sampling over the step's groups, in the order drawn: the first `wanted`
    whose rewards differ, topped up with the first all-equal ones when too few differ.
    Returns the chosen groups, in draw order, and how many were topped up."""
    chosen = [i for i, g in enumerate(groups) if informative(g)][:wanted]
    filled = [i for i, g in enumerate(groups) if not informative(g)][:wanted - len(chosen)]
    return [groups[i] for i in sorted(chosen + filled)], len(filled)


def sampling_weights(old: Tensor, sampled: Tensor, mask: Tensor, mode: str,
                     low: float | None, high: float | None) -> Tensor:
    """Truncated importance-sampling weights for the gap between the trainer's log-probs of
    the rollout policy (`old`) and the engine's (`sampled`), as TRL's
    vllm_importance_sampling_mode computes them: exp(old − sampled) per token, or of its sum
    per completion (sequence_*), clamped to [low, high] (*_truncate) or 0 outside it
    (*_mask)."""
    diff = (old - sampled) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    outside = (ratio < (0.0 if low is None else low)) | (
        ratio > (float("inf") if high is None else high))
    return ratio.masked_fill(outside, 0.0)


def per_token_logps(model: nn.Module, batch: dict[str, Any], temperature: float = 1.0
                    ) -> tuple[Tensor, RouterStats | None]:
    """log p(label_t | tokens < t) per position of a collated batch of rollouts (0 where
    unlabelled), from logits / `temperature` (the distribution the rollouts were sampled
    from), and a mixture of experts' routing (`labelled_logprobs`)."""
    return labelled_logprobs(model, batch, temperature=temperature if temperature > 0 else 1.0)


Round = tuple[list[Rollout], dict[str, float]]  # a generation round's rollouts, tool metrics


def sample_round(runtime: Runtime, config: GRPOConfig, sampler: ShuffledBatches,
                 generator: RolloutGenerator, first: int, step: int, index: int) -> Round:
    """Generation round `index` of step `step` (which seeds it): the next batch of prompts
    from `sampler`, this rank's share of them (from its `first`), `num_generations`
    completions each, scored, the overlong rule applied. No collective, so a background
    thread may draw it."""
    wanted = config.prompts_per_step // runtime.world_size
    params = SamplingParams(max_tokens=config.max_completion_tokens,
                            temperature=config.temperature, top_p=config.top_p,
                            n=config.num_generations, logprobs=0,
                            logprobs_at_temperature=True)
    mine = sampler.next()[first:first + wanted]
    with runtime.autocast():
        rollouts, tool_metrics = generator(mine, params,
                                           seed=config.seed * 7919 + step * 104729,
                                           first=index * config.prompts_per_step + first)
    for r in rollouts:
        if config.overlong == "soft_penalty":
            r.reward += overlong_penalty(len(r.completion_ids), config.max_completion_tokens,
                                         config.overlong_buffer)
        r.masked = r.truncated and config.overlong == "filter"
    return rollouts, tool_metrics


def sample_groups(runtime: Runtime, config: GRPOConfig, sampler: ShuffledBatches,
                  generator: RolloutGenerator, first: int, step: int,
                  drawn: Round | None = None,
                  ) -> tuple[list[list[Rollout]], list[Rollout], dict[str, float]]:
    """This rank's groups to train on this step, every rollout it sampled, and its
    per-rank metrics. One generation round of the rank's share of the step's prompts (or
    `drawn`, the first round already sampled); with dynamic sampling, rounds until every
    rank holds enough groups whose rewards differ or the rounds are spent (collective:
    every rank draws every round, so the ranks' prompt samplers stay in step and a resumed
    run draws what the killed one would have). `step`: the optimizer step the rollouts are
    for, which seeds them."""
    wanted = config.prompts_per_step // runtime.world_size
    size = config.num_generations
    groups: list[list[Rollout]] = []
    sampled: list[Rollout] = []
    rounds: list[dict[str, float]] = []
    while len(rounds) < (config.dynamic_sampling_rounds if config.dynamic_sampling else 1):
        rollouts, tool_metrics = drawn if drawn is not None and not rounds else sample_round(
            runtime, config, sampler, generator, first, step, len(rounds))
        sampled += rollouts
        rounds.append(tool_metrics)
        groups += [rollouts[i:i + size] for i in range(0, len(rollouts), size)]
        short = sum(map(informative, groups)) < wanted
        if not config.dynamic_sampling or not runtime.accelerator.reduce(
                torch.tensor([float(short)], device=runtime.device), reduction="sum").item():
            break
    metrics = {name: sum(r[name] for r in rounds) / len(rounds) for name in rounds[0]}
    if config.dynamic_sampling:
        drawn_groups = len(groups)
        metrics["dynamic/informative_share"] = sum(map(informative, groups)) / drawn_groups
        groups, filled = select_groups(groups, wanted)
        metrics["dynamic/rounds"] = float(len(rounds))
        metrics["dynamic/filled_share"] = filled / wanted
    return groups, sampled, metrics


class RolloutSampler:
    """Each step's rollouts: sampled when the step asks for them (synchronous), or with
    rollout.max_staleness 1 its first generation round sampled in a thread while the step
    before trains — by the weights the server holds then, one step older than the policy
    that trains on them; dynamic sampling's further rounds, whose count the ranks agree on
    by a collective, are drawn when the step asks, by the current weights. The prompt order
    is the same either way, and `resume_state` is the prompt sampler's state before any
    draw not yet trained on."""

    def __init__(self, runtime: Runtime, config: GRPOConfig, sampler: ShuffledBatches,
                 generator: RolloutGenerator, first: int) -> None:
        self.runtime, self.config, self.sampler = runtime, config, sampler
        self.generator, self.first = generator, first
        self.pool = ThreadPoolExecutor(max_workers=1) if config.rollout.max_staleness else None
        self.ahead: Future | None = None
        self._held: dict[str, int] = {}

    @property
    def resume_state(self) -> dict[str, int]:
        return self._held if self.ahead is not None else self.sampler.state_dict()

    def take(self, step: int) -> tuple[list[list[Rollout]], list[Rollout], dict[str, float],
                                       float]:
        """Step `step`'s rollouts, and the seconds spent waiting for them; asynchronous, the
        next step's first round starts sampling as this returns."""
        started = time.perf_counter()
        stale = self.ahead is not None
        groups, sampled, metrics = sample_groups(
            self.runtime, self.config, self.sampler, self.generator, self.first, step,
            self.ahead.result() if stale else None)
        seconds = time.perf_counter() - started
        if self.pool is None:
            return groups, sampled, metrics, seconds
        self._held = self.sampler.state_dict()
        self.ahead = self.pool.submit(sample_round, self.runtime, self.config, self.sampler,
                                      self.generator, self.first,
                                      step + self.config.updates_per_batch, 0)
        return groups, sampled, {**metrics, "rollout/staleness": float(stale)}, seconds

    def close(self) -> None:
        if self.pool is not None:
            if self.ahead is not None:
                self.ahead.result()
            self.pool.shutdown()


def rollout_summary(runtime: Runtime, rollouts: list[Rollout], seconds: float, gap: float,
                    rank_metrics: dict[str, float]) -> dict[str, float]:
    """The step's rollout metrics over every rank's rollouts (collective), so that each
    rank logs, and the main process's history keeps, the whole step's; `rank_metrics` are
    averaged over the ranks."""
    accelerator, device = runtime.accelerator, runtime.device
    local = torch.tensor([[r.reward, float(r.correct), float(sum(r.policy)), float(r.truncated),
                           float(r.policy_version)] for r in rollouts], dtype=torch.float64,
                         device=device)
    rewards, correct, lengths, truncated, versions = accelerator.gather(local).T
    slowest = float(accelerator.gather(torch.tensor([seconds], device=device)).max())
    means = accelerator.reduce(torch.tensor([gap, *rank_metrics.values()], dtype=torch.float64,
                                            device=device), reduction="mean").tolist()
    return {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "train/accuracy": float(correct.mean()),
            "completion/mean_length": float(lengths.mean()),
            "completion/truncated_share": float(truncated.mean()),
            "rollout/tokens_per_s": float(lengths.sum()) / max(slowest, 1e-9),
            "rollout/logprob_gap": means[0],
            # weight versions among the step's rollouts: 0 unless a push landed mid-sampling
            "rollout/policy_version_spread": float(versions.max() - versions.min()),
            **dict(zip(rank_metrics, means[1:], strict=True))}


def refresh(runtime: Runtime, generator: RolloutGenerator, config: GRPOConfig) -> None:
    """The rollout engine takes the policy's current weights (collective); a server's, pushed
    by the main process, before any rank sends it the next step's requests."""
    generator.refresh(engine_weights(runtime, config.lora))
    if generator.remote:
        runtime.accelerator.wait_for_everyone()


def check_lengths(config: GRPOConfig, context: int) -> PromptFit:
    """max_prompt_length + max_completion_tokens must fit the model's context, once, here."""
    budget = context - config.max_completion_tokens
    limit = config.max_prompt_length if config.max_prompt_length is not None else budget
    if limit < 1 or limit > budget:
        raise ConfigError(f"max_prompt_length={limit} + max_completion_tokens="
                          f"{config.max_completion_tokens} must fit the model's context of "
                          f"{context} tokens; lower either (max_prompt_length <= {budget})")
    return PromptFit(limit, config.prompt_overflow)


def step_shape(config: GRPOConfig, parallelism: Parallelism,
               model_config: ModelConfig | None = None,
               longest_prompt: int | None = None) -> StepShape:
    """One GRPO micro-batch, for memory plans: each rank's rollouts split into
    grad_accum_steps micro-batches of prompt + completion tokens through per-token
    log-probs, beside the reference (beta > 0 without LoRA), the reward models and the rank's
    rollout engine — its own fp32 copy of the policy and its KV cache (a server's at
    rollout.url only when the run starts it on this machine). Rows are as long as
    the longest prompt the run has (`longest_prompt`, once its prompts are fitted) or may
    have (max_prompt_length, else the context) and a whole completion."""
    model_config = model_config or read_model_config(config.model)
    rows = max(config.prompts_per_step * config.num_generations // parallelism.processes
               // config.grad_accum_steps, 1)
    prompt = longest_prompt if longest_prompt is not None else config.max_prompt_length
    length = (model_config.max_seq_len if prompt is None
              else prompt + config.max_completion_tokens)
    frozen, cache = rollout_engine_bytes(model_config, parallelism.mixed_precision)
    if config.rollout.url is not None:
        # a server samples; under LoRA a base copy merges. One the run starts (`local`) is
        # on this machine, on its card too, with the in-process engine's copy and cache
        local = config.rollout.url == "local"
        frozen, cache = frozen * (local + config.lora.enabled), cache if local else 0
    if config.beta > 0 and not config.lora.enabled:
        frozen += frozen_weight_bytes(model_config, parallelism)
    frozen += sum(4 * read_model_config(r.model).num_params()  # reward models, fp32
                  for r in config.rewards if r.model is not None)
    return StepShape(rows, min(length, model_config.max_seq_len), "logprobs",
                     config.grad_accum_steps, frozen, cache, evaluation_cache_bytes(
                         model_config, parallelism.mixed_precision))


def grpo(config: GRPOConfig, resume: str = "never") -> dict[str, Any]:
    runtime = Runtime(config, stage="grpo")
    if config.prompts_per_step % runtime.world_size:
        raise ConfigError(f"prompts_per_step={config.prompts_per_step} must be divisible by the "
                          f"{runtime.world_size} processes")
    rollouts_per_rank = config.prompts_per_step * config.num_generations // runtime.world_size
    if rollouts_per_rank % config.grad_accum_steps:
        raise ConfigError(f"each rank's {rollouts_per_rank} rollouts must split evenly into "
                          f"grad_accum_steps={config.grad_accum_steps} micro-batches")
    opened = OpenCheckpoint(config.model)  # the policy, its reference and the rollout copy
    model, encoder = load_policy(runtime, config, opened)
    model_config = model.config
    fit = check_lengths(config, model_config.max_seq_len)
    episodes = EpisodeRunner(encoder, config.tools)
    prompts = fit_prompts(encoder, load_prompt_dataset(config.prompts, "train", config.limit),
                          fit, episodes.definitions())
    if len(prompts) < config.prompts_per_step:
        raise ConfigError(f"{config.prompts}: {len(prompts)} prompts left after fitting "
                          f"({fit.report()}), fewer than prompts_per_step="
                          f"{config.prompts_per_step}")
    sampler = ShuffledBatches(prompts, config.prompts_per_step, config.seed)
    total_steps = config.total_steps(1, model_config.num_params())
    runtime.prepare(model, total_steps, step_shape(config, runtime.parallelism, model_config,
                                                   max(len(p.ids) for p in prompts)))
    reference = None
    if config.beta > 0 and not config.lora.enabled:
        reference = runtime.prepare_frozen(stage_model(runtime, opened))
    restored = runtime.start(config, resume)
    if restored is not None:
        sampler.load_state_dict(restored["prompts"])
    generator = RolloutGenerator(opened, encoder, episodes, config.lora, config.rewards,
                                 config.task_eval.task, runtime.device, runtime.compute_dtype,
                                 config.rollout, pushes=runtime.is_main,
                                 local_weights=Path(config.out_dir) / "rollout-weights")
    opened.release()
    refresh(runtime, generator, config)
    prompts_per_rank = config.prompts_per_step // runtime.world_size
    first = runtime.rank * prompts_per_rank
    evaluator = TaskEvaluator(config.task_eval, config.model, encoder, episodes)
    pad_token = pad_id(encoder.tokenizer)
    runtime.print(f"grpo: {len(prompts):,} prompts ({fit.report()}), "
                  f"{config.prompts_per_step} × {config.num_generations} rollouts per batch, "
                  f"{config.updates_per_batch} update(s) each, {total_steps} optimizer steps, "
                  f"loss {config.loss_type}, scale_rewards {config.scale_rewards}, "
                  f"beta {config.beta}")
    constant = config.max_completion_tokens if config.loss_type == "dr_grpo" else None

    def work_of(batch: dict[str, Any]) -> Work:
        rows = len(batch["lengths"])
        units = rows * constant if constant else float(batch["mask"].sum())
        return sequence_work(model_config, batch["lengths"], units)

    def loss_fn(m: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        logps, router = per_token_logps(m, batch, config.temperature)
        loss, metrics = clipped_surrogate(
            logps, batch["old"], batch["advantages"], batch["mask"], config.epsilon,
            config.epsilon_high, batch.get("ref"), config.beta,
            len(batch["lengths"]) * constant if constant else None,
            config.importance_sampling_level == "sequence", config.kl_importance_correction,
            batch.get("weight"))
        return with_routing(loss, metrics, router)

    history = stage_history(restored, "reward", "accuracy", "heldout_accuracy")
    if restored is None:
        history["heldout_accuracy"].append(evaluate_task(runtime, evaluator, config.lora))
    rollout_sampler = RolloutSampler(runtime, config, sampler, generator, first)
    while runtime.step < total_steps:
        with runtime.throughput.paused():
            groups, sampled, rank_metrics, rollout_seconds = rollout_sampler.take(runtime.step)
        rollouts = [r for group in groups for r in group]
        rewards = torch.tensor([r.reward for r in rollouts]).view(len(groups), -1)
        for rollout, advantage in zip(rollouts, group_advantages(
                rewards, config.scale_rewards).flatten().tolist(), strict=True):
            rollout.advantage = advantage
        size = rollouts_per_rank // config.grad_accum_steps
        micro = [collate(rollouts[i:i + size], pad_token, runtime.device)
                 for i in range(0, rollouts_per_rank, size)]
        with runtime.autocast():
            gap = attach_old_and_reference(
                runtime.model, reference, micro, config.lora.enabled and config.beta > 0,
                config.temperature, (config.sampling_correction, config.sampling_correction_min,
                                     config.sampling_correction_max))
        forwards = 1 + (config.beta > 0)  # old log-probs, and the reference's
        runtime.throughput.add(0, forwards / 3 * runtime.world_size * sum(
            sequence_work(model_config, m["lengths"], 0).flops for m in micro))
        rollout_metrics = rollout_summary(runtime, sampled, rollout_seconds, gap,
                                          rank_metrics)
        for _ in range(config.updates_per_batch):
            if runtime.step >= total_steps:
                break
            result = runtime.train_step(micro, loss_fn, work_of)
            result.metrics.update(rollout_metrics)
            runtime.log_step(result)
        history["reward"].append(rollout_metrics["reward/mean"])
        history["accuracy"].append(rollout_metrics["train/accuracy"])
        refresh(runtime, generator, config)
        if runtime.should(config.eval.every):
            with runtime.throughput.paused():
                accuracy = evaluate_task(runtime, evaluator, config.lora)
            history["heldout_accuracy"].append(accuracy)
            runtime.print(f"step {runtime.step}: reward {rollout_metrics['reward/mean']:.3f}, "
                          f"rollout accuracy {rollout_metrics['train/accuracy']:.1%}, "
                          f"held-out accuracy {percent(accuracy)}")
            if stop_reached(runtime, config.task_eval, accuracy):
                break
        if runtime.should(config.checkpoint.every):
            runtime.save({"prompts": rollout_sampler.resume_state, "history": history})

    rollout_sampler.close()
    generator.close()
    episodes.close()
    summary = finish_stage(runtime, config, model_config, history, ["reward", "heldout_accuracy"],
                           {"prompt_fit": fit.counts()})
    if runtime.is_main:
        first, last = history["reward"][:5], history["reward"][-5:]
        print(f"done: grpo {runtime.step} steps in {summary['seconds']:.0f}s; mean reward "
              f"{sum(first) / len(first):.3f} (first 5 batches) -> {sum(last) / len(last):.3f} "
              f"(last 5), held-out accuracy {percent(history['heldout_accuracy'][0])} -> "
              f"{percent(history['heldout_accuracy'][-1])}\ncheckpoint: {summary['final']}")
    return summary


@torch.no_grad()
def attach_old_and_reference(model: nn.Module, reference: nn.Module | None,
                             micro: list[dict[str, Any]], lora_reference: bool,
                             temperature: float,
                             correction: tuple[str, float | None, float | None] = ("none",
                                                                                  None, None),
                             ) -> float:
    """Log-probs of the rollout policy (before this batch's updates) and of the reference,
    at the sampling temperature, and the sampling-gap weights when `correction` (mode, min,
    max) asks for them; returns the mean |trainer − engine| log-prob over the completion
    tokens, which only numerics (precision, kernels) should separate."""
    model.eval()
    gap, tokens = 0.0, 0
    for batch in micro:
        mask = batch["mask"]
        batch["old"] = per_token_logps(model, batch, temperature)[0]
        gap += float(((batch["old"] - batch["sampled"]).abs() * mask).sum())
        if correction[0] != "none":
            batch["weight"] = sampling_weights(batch["old"], batch["sampled"], mask, *correction)
        tokens += int(mask.sum())
        if reference is not None:
            batch["ref"] = per_token_logps(reference, batch, temperature)[0]
        elif lora_reference:
            with adapters_disabled(model):
                batch["ref"] = per_token_logps(model, batch, temperature)[0]
    model.train()
    return gap / max(tokens, 1)


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("grpo", "GRPO with verifiable rewards; rollouts from the serve engine.",
                      GRPOConfig, grpo, argv)


if __name__ == "__main__":
    import sys

    from lathe.core.cli import exit_process, run_command
    exit_process(run_command("grpo", sys.argv[1:]))
