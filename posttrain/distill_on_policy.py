"""On-policy distillation (`lathe distill --mode on_policy`; GKD, Agarwal et al. 2024, as
TRL's DistillationTrainer computes it): each step the student samples a completion to each
of its prompts on its rollout engine, and learns to match the teacher's next-token
distributions on its own tokens — reverse KL by choice (mode-seeking: the student is
corrected where it goes, not where the teacher would go) or the generalized JSD. The
divergence runs a chunk of rows at a time, so neither model's full-vocabulary logits are
held. With `rewards` the samples are also scored, and REINFORCE on them (the step's mean
reward as baseline) is mixed in by `reward_weight`. Held out: KL(student ‖ teacher) on the
student's samples of held-out prompts, each seeded by its index, so that every evaluation
scores the same draws of a changing student.

Every rank samples its share of the step's prompts (seeded by each prompt's index in the
step, as GRPO's rollouts are) and trains on them; the engine takes the student's weights
after each step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder
from lathe.data.formats import load_prompt_dataset
from lathe.data.mixture import load_rows
from lathe.model.checkpoint import OpenCheckpoint, read_model_config
from lathe.model.config import ModelConfig
from lathe.model.transformer import routing_metrics
from lathe.posttrain.common import (
    PromptFit,
    ShuffledBatches,
    TaskEvaluator,
    evaluate_task,
    evaluation_cache_bytes,
    finish_stage,
    load_policy,
    pad_id,
    rank_batches,
    real_tokens,
    sequence_work,
    stage_history,
    stage_model,
)
from lathe.posttrain.config import DistillConfig
from lathe.posttrain.divergence import DistillationLoss, check_vocabularies, teacher_rows
from lathe.posttrain.rollouts import (
    Prompt,
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

HELDOUT_SEED = 99991  # the held-out samples' seeds, apart from any step's


def step_shape(config: DistillConfig, parallelism: Parallelism,
               model_config: ModelConfig | None = None,
               longest_prompt: int | None = None) -> StepShape:
    """One micro-batch of on-policy distillation, for memory plans: micro_batch_size
    prompts with their samples (as long as the longest prompt, once known, and a whole
    sample; else the context) through the divergence head, beside the teacher's weights
    and the rank's rollout engine."""
    model_config = model_config or read_model_config(config.model)
    length = model_config.max_seq_len if longest_prompt is None else min(
        longest_prompt + config.max_completion_tokens, model_config.max_seq_len)
    engine, cache = rollout_engine_bytes(model_config, parallelism.mixed_precision)
    teacher = frozen_weight_bytes(read_model_config(config.teacher), parallelism)
    return StepShape(config.micro_batch_size, length, "loss",
                     config.grad_accum_steps, teacher + engine, cache,
                     evaluation_cache_bytes(model_config, parallelism.mixed_precision))


def prompt_sets(config: DistillConfig, tools: list[dict[str, Any]] | None,
                encoder: ChatEncoder, context: int
                ) -> tuple[list[Prompt], list[Prompt], PromptFit]:
    """The training and held-out prompts of `config.data`, rendered and fitted so that a
    prompt and max_completion_tokens fit the context (longer ones are dropped, counted)."""
    budget = context - config.max_completion_tokens
    if budget < 1:
        raise ConfigError(f"max_completion_tokens={config.max_completion_tokens} leaves no room "
                          f"for a prompt in the student's context of {context} tokens; lower it")
    data, fit = config.data, PromptFit(budget, "drop")
    rows, _ = load_rows(data.train, load_prompt_dataset, "train", data.limit, config.seed)
    train = fit_prompts(encoder, rows, fit, tools)
    held, _ = load_rows(data.eval or data.train, load_prompt_dataset, "test",
                        config.eval.batches * config.micro_batch_size, config.seed)
    return train, fit_prompts(encoder, held, PromptFit(budget, "drop"), tools), fit


def baseline(runtime: Runtime, rollouts: list[Rollout]) -> float:
    """Each rollout's advantage, its reward less the step's mean over every rank's samples
    (collective), set on it; that mean."""
    local = torch.tensor([sum(r.reward for r in rollouts), len(rollouts)],
                         dtype=torch.float64, device=runtime.device)
    total, count = runtime.accelerator.reduce(local, reduction="sum").tolist()
    mean = total / count
    for rollout in rollouts:
        rollout.advantage = rollout.reward - mean
    return mean


def distill_on_policy(config: DistillConfig, teacher_checkpoint: OpenCheckpoint,
                      resume: str) -> dict[str, Any]:
    runtime = Runtime(config, stage="distill")
    opened = OpenCheckpoint(config.model)  # the student, and its rollout engine's copy
    model, encoder = load_policy(runtime, config, opened)
    teacher = stage_model(runtime, teacher_checkpoint)
    check_vocabularies(model, teacher)
    model_config = model.config
    episodes = EpisodeRunner(encoder, config.tools)
    prompts, heldout, fit = prompt_sets(config, episodes.definitions(), encoder,
                                        model_config.max_seq_len)
    per_rank = config.micro_batch_size * config.grad_accum_steps
    if len(prompts) < per_rank * runtime.world_size:
        raise ConfigError(f"{config.data.train}: {len(prompts)} prompts left after fitting "
                          f"({fit.report()}), fewer than one step's micro_batch_size × "
                          f"grad_accum_steps × {runtime.world_size} ranks")
    sampler = ShuffledBatches(prompts, per_rank * runtime.world_size, config.seed)
    mean_prompt = sum(len(p.ids) for p in prompts) / len(prompts)
    total_steps = config.total_steps(int(per_rank * runtime.world_size * (
        mean_prompt + config.max_completion_tokens)), model_config.num_params())
    runtime.prepare(model, total_steps, step_shape(config, runtime.parallelism, model_config,
                                                   max(len(p.ids) for p in prompts)))
    teacher = runtime.prepare_frozen(teacher)
    restored = runtime.start(config, resume)
    if restored is not None:
        sampler.load_state_dict(restored["prompts"])
    generator = RolloutGenerator(opened, encoder, episodes, config.lora, config.rewards,
                                 config.task_eval.task, runtime.device, runtime.compute_dtype)
    opened.release()
    generator.refresh(engine_weights(runtime, config.lora))
    params = SamplingParams(max_tokens=config.max_completion_tokens,
                            temperature=config.temperature, top_p=config.top_p, logprobs=0)
    pad_token, first = pad_id(encoder.tokenizer), runtime.rank * per_rank

    def batches(rollouts: list[Rollout]) -> list[dict[str, Any]]:
        size = config.micro_batch_size
        return [collate(rollouts[i:i + size], pad_token, runtime.device)
                for i in range(0, len(rollouts), size)]

    def work_of(batch: dict[str, Any]) -> Work:  # plus the teacher's forward (1/3 of a step)
        work = sequence_work(model_config, batch["lengths"], float(batch["mask"].sum()))
        return dataclasses.replace(work, flops=work.flops * 4 / 3)

    def loss_fn(m: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        ids, labels = batch["ids"], batch["labels"]
        op = DistillationLoss(labels, teacher_rows(runtime, teacher, ids), config,
                              batch["advantages"] if config.rewards else None)
        out = m(ids, labels=labels, head_op=op, token_mask=real_tokens(batch))
        return out.loss, {"loss": out.loss, "kd": op.parts["kd"], **(
            {"pg": op.parts["pg"]} if "pg" in op.parts else {}),
            **routing_metrics(out.router)}

    scored = dataclasses.replace(config, loss="reverse_kl", temperature=1.0, ce_weight=0.0)

    @torch.no_grad()
    def heldout_kl() -> float:
        """KL(student ‖ teacher) at T=1 per token of the student's held-out samples
        (collective: every rank samples and scores its share)."""
        sums = torch.zeros(2, device=runtime.device)
        share = -(-len(heldout) // runtime.world_size)
        for index, (rows, counts) in enumerate(rank_batches(
                heldout, config.micro_batch_size, runtime.rank, runtime.world_size)):
            with runtime.autocast():
                rollouts, _ = generator(rows, params, HELDOUT_SEED, runtime.rank * share
                                        + index * config.micro_batch_size)
            runtime.model.eval()
            for batch in batches(rollouts):
                tokens = batch["mask"].sum() * counts
                op = DistillationLoss(batch["labels"], teacher_rows(
                    runtime, teacher, batch["ids"]), scored)
                with runtime.autocast():
                    kl = runtime.model(batch["ids"], head_op=op).head
                sums += torch.stack([kl * tokens, tokens.float()])
            runtime.model.train()
        sums = runtime.accelerator.reduce(sums, reduction="sum")
        return float(sums[0] / sums[1].clamp(min=1))

    history = stage_history(restored, "reverse_kl")
    kls = history["reverse_kl"]

    def evaluate() -> None:
        with runtime.throughput.paused():
            kls.append(heldout_kl())
        runtime.log({"eval/reverse_kl": kls[-1]})
        runtime.print(f"step {runtime.step}: held-out KL(student ‖ teacher) on its own "
                      f"samples {kls[-1]:.4f}")

    runtime.print(f"distill on_policy ({config.loss}, T={config.temperature}): "
                  f"{len(prompts):,} prompts ({fit.report()}), {per_rank * runtime.world_size} "
                  f"samples a step of up to {config.max_completion_tokens} tokens, "
                  f"{total_steps} steps")
    if restored is None:
        evaluate()
    while runtime.step < total_steps:
        mine = sampler.next()[first:first + per_rank]
        with runtime.throughput.paused(), runtime.autocast():
            rollouts, _ = generator(mine, params, config.seed * 7919 + runtime.step * 104729,
                                    first)
        reward = baseline(runtime, rollouts) if config.rewards else None
        result = runtime.train_step(batches(rollouts), loss_fn, work_of)
        result.metrics["completion/mean_length"] = sum(sum(r.policy) for r in rollouts) / len(
            rollouts)
        if reward is not None:
            result.metrics["reward/mean"] = reward
        runtime.log_step(result)
        generator.refresh(engine_weights(runtime, config.lora))
        if runtime.should(config.eval.every):
            evaluate()
        if runtime.should(config.checkpoint.every):
            runtime.save({"prompts": sampler.state_dict(), "history": history})

    student_accuracy = evaluate_task(runtime, TaskEvaluator(
        config.task_eval, config.model, encoder, episodes), config.lora)
    episodes.close()
    summary = finish_stage(runtime, config, model_config, history, ["reverse_kl"],
                           {"prompt_fit": fit.counts()})
    return {**summary, "student_accuracy": student_accuracy}
