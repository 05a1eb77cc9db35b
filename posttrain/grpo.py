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
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from torch import Tensor, nn

from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder
from lathe.data.formats import PromptRow, load_prompt_dataset
from lathe.model.checkpoint import OpenCheckpoint, read_model_config
from lathe.model.config import ModelConfig
from lathe.model.head_ops import LabelLogprobs
from lathe.model.lora import (
    AdapterMerger,
    adapter_pairs,
    adapter_weights,
    adapters_disabled,
    has_experts,
)
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.common import (
    PromptFit,
    ShuffledBatches,
    TaskEvaluator,
    evaluate_task,
    evaluation_cache_bytes,
    finish_stage,
    load_policy,
    pad,
    pad_id,
    percent,
    sequence_work,
    stage_history,
    stage_main,
    stop_reached,
)
from lathe.posttrain.config import GRPOConfig
from lathe.posttrain.rewards import Reward, load_reward, verifier
from lathe.posttrain.tool_episodes import Episode, EpisodePrompt, EpisodeRunner
from lathe.pretrain.runtime.memory_plan import Parallelism, StepShape, frozen_weight_bytes
from lathe.pretrain.runtime.precision import compute_dtype
from lathe.pretrain.runtime.trainer import Runtime, Work
from lathe.serve.engine import EngineConfig, LLMEngine
from lathe.serve.paged_cache import KVSlabs
from lathe.serve.sampling import SamplingParams


@dataclass
class Prompt:
    row: PromptRow
    ids: list[int]  # the rendered chat, fitted to max_prompt_length


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]  # the model's tokens, and with tools the results' between turns
    reward: float
    correct: float
    sampled_logps: list[float]  # the engine's, at the sampling temperature
    policy: list[bool]  # which completion tokens the model sampled (the rest carry no loss)
    truncated: bool = False  # cut at max_completion_tokens
    masked: bool = False  # left out of the loss (overlong: filter)
    advantage: float = 0.0


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


def per_token_logps(model: nn.Module, ids: Tensor, labels: Tensor,
                    temperature: float = 1.0) -> Tensor:
    """log p(label_t | tokens < t) per position of the (N, T) batch (0 where unlabelled),
    from logits / `temperature`: the distribution the rollouts were sampled from."""
    op = LabelLogprobs(labels, temperature if temperature > 0 else 1.0)
    return model(ids, head_op=op).head


def collate(rollouts: list[Rollout], pad_token: int, device: torch.device) -> dict[str, Any]:
    ids = pad([r.prompt_ids + r.completion_ids for r in rollouts], pad_token).to(device)
    labels = pad([[IGNORE_INDEX] * len(r.prompt_ids) + [
        token if sampled and not r.masked else IGNORE_INDEX for token, sampled in zip(
            r.completion_ids, r.policy, strict=True)] for r in rollouts], IGNORE_INDEX).to(device)
    sampled = pad([[0.0] * len(r.prompt_ids) + r.sampled_logps for r in rollouts], 0.0)
    return {"ids": ids, "labels": labels, "mask": labels[:, 1:] != IGNORE_INDEX,
            "sampled": sampled[:, 1:].to(device),
            "lengths": [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts],
            "advantages": torch.tensor([r.advantage for r in rollouts], device=device)}


def fit_prompts(encoder: ChatEncoder, rows: list[PromptRow], fit: PromptFit,
                tools: list[dict[str, Any]] | None = None) -> list[Prompt]:
    """Each row rendered with its tools (or `tools`, the stage's, when it has none) and
    fitted; rows that do not fit are dropped or cut as `fit` says."""
    prompts = []
    for row in rows:
        row = dataclasses.replace(row, tools=row.tools or tools)
        ids = fit(encoder.prompt(row.prompt, row.tools))
        if ids is not None:
            prompts.append(Prompt(row, ids))
    return prompts


ROLLOUT_BLOCKS = 1024  # the rollout engine's KV cache, in blocks of EngineConfig.block_size
POLICY_ADAPTER = "policy"  # the rollout engine's name for the policy's current adapters


class RolloutGenerator:
    """The serve engine on its own copy of the policy: G episodes per prompt (one turn
    each, or with `tools` turns that call them), scored. Under LoRA the engine keeps the
    full-precision base and serves the policy's current adapters from an adapter slot,
    refreshed each step without touching the base (LoRA on lm_head or a mixture of
    experts' experts, which slots do not take, merges into a copy of the base instead);
    never a merge into a 4-bit QLoRA base."""

    def __init__(self, config: GRPOConfig, opened: OpenCheckpoint, encoder: ChatEncoder,
                 episodes: EpisodeRunner, device: torch.device, kv_dtype: torch.dtype) -> None:
        self.config, self.episodes = config, episodes
        self.rewards = [(load_reward(r.name), r.weight) for r in config.rewards]
        self.correct = verifier(config.task_eval.task)
        model = opened.model(dtype=torch.float32, device=device)
        lora = config.lora
        slot_takes = "lm_head" not in lora.target_modules and not (
            has_experts(model) and lora.expert_parameters())
        self.adapter = POLICY_ADAPTER if lora.enabled and slot_takes else None
        self.merger = AdapterMerger(model, lora) if lora.enabled and self.adapter is None \
            else None
        slots = dict(max_loras=1, max_lora_rank=lora.r) if self.adapter is not None else {}
        engine_config = EngineConfig(num_blocks=ROLLOUT_BLOCKS, retain_freed_memory=False,
                                     **slots)
        self.engine = LLMEngine(model.eval(), encoder.tokenizer, engine_config, opened.eos_ids,
                                kv_dtype=kv_dtype)

    def refresh(self, weights: dict[str, Tensor]) -> None:
        """Take the policy's gathered weights (its adapters alone under LoRA)."""
        if self.adapter is not None:
            self.engine.put_adapter(self.adapter, adapter_pairs(weights), self.config.lora.scale)
        else:
            self.engine.load_weights(self.merger(weights) if self.merger is not None
                                     else weights)

    def __call__(self, prompts: list[Prompt], seed: int,
                 first: int = 0) -> tuple[list[Rollout], dict[str, float]]:
        """The rollouts of `prompts`, the step's from its `first`-th on (each prompt seeded by
        its index in the step, whichever rank samples it), and their episodes' tool metrics."""
        c = self.config
        params = [SamplingParams(max_tokens=c.max_completion_tokens, temperature=c.temperature,
                                 top_p=c.top_p, n=c.num_generations, seed=seed + i * 1000,
                                 logprobs=0, logprobs_at_temperature=True)
                  for i in range(first, first + len(prompts))]
        groups = self.episodes.run(self.engine, [EpisodePrompt(p.ids, p.row.prompt, p.row.tools)
                                                 for p in prompts], params, self.adapter)
        rollouts, episodes = [], [e for group in groups for e in group]
        for prompt, group in zip(prompts, groups, strict=True):
            reference = prompt.row.reference
            for e in group:
                reward = episode_reward(self.rewards, e, reference)
                if c.overlong == "soft_penalty":
                    reward += overlong_penalty(len(e.completion_ids), c.max_completion_tokens,
                                               c.overlong_buffer)
                truncated = e.finish_reason == "length"
                rollouts.append(Rollout(prompt.ids, e.completion_ids, reward,
                                        self.correct(e.answer, reference), e.logprobs,
                                        e.policy, truncated,
                                        truncated and c.overlong == "filter"))
        metrics = {}
        if self.episodes.tools is not None:
            n = len(episodes)
            metrics = {"tools/calls_per_episode": sum(e.tool_calls for e in episodes) / n,
                       "tools/errors_per_episode": sum(e.tool_errors for e in episodes) / n,
                       "tools/turns_per_episode": sum(e.turns for e in episodes) / n,
                       "tools/unfinished": sum(e.finish_reason != "stop" for e in episodes) / n}
        return rollouts, metrics


def episode_reward(rewards: list[tuple[Reward, float]], episode: Episode,
                   reference: str) -> float:
    """The weighted sum of `rewards` on the episode's answer; a reward that takes
    `messages` is also given the whole episode's (its tool calls and results)."""
    return sum(weight * reward(episode.answer, reference, **(
        {"messages": episode.messages} if _takes_messages(reward) else {}))
        for reward, weight in rewards)


@functools.cache
def _takes_messages(reward: Reward) -> bool:
    try:
        return "messages" in inspect.signature(reward).parameters
    except (TypeError, ValueError):
        return False


def engine_weights(runtime: Runtime, config: GRPOConfig) -> dict[str, Tensor]:
    """What every rank's rollout engine needs from the policy (collective): the full
    weights, or under LoRA the adapter weights only — each rank's own where it holds them
    whole, else gathered from the shards on the main process and broadcast."""
    model = runtime.accelerator.unwrap_model(runtime.model)
    if config.lora.enabled and not runtime.sharded:
        return adapter_weights(model)
    state = runtime.accelerator.get_state_dict(runtime.model)
    if runtime.is_main or not runtime.shards_weights:
        state = {k: v.detach().clone() for k, v in state.items()
                 if not config.lora.enabled or ".lora_" in k}
    if runtime.shards_weights:
        state = broadcast_state(state if runtime.is_main else None, runtime.device)
    return state


def sample_groups(runtime: Runtime, config: GRPOConfig, sampler: ShuffledBatches,
                  generator: RolloutGenerator, first: int,
                  ) -> tuple[list[list[Rollout]], list[Rollout], dict[str, float]]:
    """This rank's groups to train on this step, every rollout it sampled, and its
    per-rank metrics. One generation round of the rank's share of the step's prompts; with
    dynamic sampling, rounds until every rank holds enough groups whose rewards differ or
    the rounds are spent (collective: every rank draws every round, so the ranks' prompt
    samplers stay in step and a resumed run draws what the killed one would have)."""
    wanted = config.prompts_per_step // runtime.world_size
    size = config.num_generations
    groups: list[list[Rollout]] = []
    sampled: list[Rollout] = []
    rounds: list[dict[str, float]] = []
    while len(rounds) < (config.dynamic_sampling_rounds if config.dynamic_sampling else 1):
        mine = sampler.next()[first:first + wanted]
        with runtime.autocast():
            rollouts, tool_metrics = generator(
                mine, seed=config.seed * 7919 + runtime.step * 104729,
                first=len(rounds) * config.prompts_per_step + first)
        sampled += rollouts
        rounds.append(tool_metrics)
        groups += [rollouts[i:i + size] for i in range(0, len(rollouts), size)]
        short = sum(map(informative, groups)) < wanted
        if not config.dynamic_sampling or not runtime.accelerator.reduce(
                torch.tensor([float(short)], device=runtime.device), reduction="sum").item():
            break
    metrics = {name: sum(r[name] for r in rounds) / len(rounds) for name in rounds[0]}
    if config.dynamic_sampling:
        drawn = len(groups)
        metrics["dynamic/informative_share"] = sum(map(informative, groups)) / drawn
        groups, filled = select_groups(groups, wanted)
        metrics["dynamic/rounds"] = float(len(rounds))
        metrics["dynamic/filled_share"] = filled / wanted
    return groups, sampled, metrics


def rollout_summary(runtime: Runtime, rollouts: list[Rollout], seconds: float, gap: float,
                    rank_metrics: dict[str, float]) -> dict[str, float]:
    """The step's rollout metrics over every rank's rollouts (collective), so that each
    rank logs, and the main process's history keeps, the whole step's; `rank_metrics` are
    averaged over the ranks."""
    accelerator, device = runtime.accelerator, runtime.device
    local = torch.tensor([[r.reward, float(r.correct), float(sum(r.policy)), float(r.truncated)]
                          for r in rollouts], dtype=torch.float64, device=device)
    rewards, correct, lengths, truncated = accelerator.gather(local).T
    slowest = float(accelerator.gather(torch.tensor([seconds], device=device)).max())
    means = accelerator.reduce(torch.tensor([gap, *rank_metrics.values()], dtype=torch.float64,
                                            device=device), reduction="mean").tolist()
    return {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "train/accuracy": float(correct.mean()),
            "completion/mean_length": float(lengths.mean()),
            "completion/truncated_share": float(truncated.mean()),
            "rollout/tokens_per_s": float(lengths.sum()) / max(slowest, 1e-9),
            "rollout/logprob_gap": means[0], **dict(zip(rank_metrics, means[1:], strict=True))}


def broadcast_state(state: dict[str, Tensor] | None, device: torch.device) -> dict[str, Tensor]:
    """The main process's `state` on every rank (collective): names, shapes and dtypes as one
    object, then each tensor through the launch's own collective (on `device`: NCCL moves
    only device tensors), returned on the CPU."""
    meta = [None if state is None else [(k, v.shape, v.dtype) for k, v in state.items()]]
    broadcast_object_list(meta)
    out = {}
    for name, shape, dtype in meta[0]:
        tensor = state[name].to(device) if state is not None else torch.empty(
            shape, dtype=dtype, device=device)
        torch.distributed.broadcast(tensor, src=0)
        out[name] = tensor.cpu()
    return out


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
               model_config: ModelConfig | None = None) -> StepShape:
    """One GRPO micro-batch, for memory plans: each rank's rollouts split into
    grad_accum_steps micro-batches of prompt + completion tokens through per-token
    log-probs, beside the reference (beta > 0 without LoRA) and the rank's rollout engine —
    its own fp32 copy of the policy and a KV cache of ROLLOUT_BLOCKS blocks."""
    model_config = model_config or read_model_config(config.model)
    rows = max(config.prompts_per_step * config.num_generations // parallelism.processes
               // config.grad_accum_steps, 1)
    length = (model_config.max_seq_len if config.max_prompt_length is None
              else config.max_prompt_length + config.max_completion_tokens)
    frozen = 4 * model_config.num_params()  # the engine's copy
    if config.beta > 0 and not config.lora.enabled:
        frozen += frozen_weight_bytes(model_config, parallelism)
    block = EngineConfig().block_size
    cache = (ROLLOUT_BLOCKS + 1) * KVSlabs.bytes_per_block(
        model_config, block, compute_dtype(parallelism.mixed_precision))
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
    runtime.prepare(model, total_steps, step_shape(config, runtime.parallelism, model_config))
    reference = None
    if config.beta > 0 and not config.lora.enabled:
        reference = runtime.prepare_frozen(opened.model(dtype=torch.float32))
    restored = runtime.start(config, resume)
    if restored is not None:
        sampler.load_state_dict(restored["prompts"])
    generator = RolloutGenerator(config, opened, encoder, episodes, runtime.device,
                                 runtime.compute_dtype)
    opened.release()
    generator.refresh(engine_weights(runtime, config))
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
        logps = per_token_logps(m, batch["ids"], batch["labels"], config.temperature)
        return clipped_surrogate(logps, batch["old"], batch["advantages"], batch["mask"],
                                 config.epsilon, config.epsilon_high, batch.get("ref"),
                                 config.beta, len(batch["lengths"]) * constant if constant
                                 else None, config.importance_sampling_level == "sequence",
                                 config.kl_importance_correction, batch.get("weight"))

    history = stage_history(restored, "reward", "accuracy", "heldout_accuracy")
    if restored is None:
        history["heldout_accuracy"].append(evaluate_task(runtime, evaluator, config.lora))
    while runtime.step < total_steps:
        with runtime.throughput.paused():
            started = time.perf_counter()
            groups, sampled, rank_metrics = sample_groups(runtime, config, sampler, generator,
                                                          first)
            rollout_seconds = time.perf_counter() - started
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
        generator.refresh(engine_weights(runtime, config))
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
            runtime.save({"prompts": sampler.state_dict(), "history": history})

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
        ids, labels, mask = batch["ids"], batch["labels"], batch["mask"]
        batch["old"] = per_token_logps(model, ids, labels, temperature)
        gap += float(((batch["old"] - batch["sampled"]).abs() * mask).sum())
        if correction[0] != "none":
            batch["weight"] = sampling_weights(batch["old"], batch["sampled"], mask, *correction)
        tokens += int(mask.sum())
        if reference is not None:
            batch["ref"] = per_token_logps(reference, ids, labels, temperature)
        elif lora_reference:
            with adapters_disabled(model):
                batch["ref"] = per_token_logps(model, ids, labels, temperature)
    model.train()
    return gap / max(tokens, 1)


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("grpo", "GRPO with verifiable rewards; rollouts from the serve engine.",
                      GRPOConfig, grpo, argv)


if __name__ == "__main__":
    import sys

    from lathe.core.cli import exit_process, run_command
    exit_process(run_command("grpo", sys.argv[1:]))
