"""Direct preference optimization (`lathe dpo` / `accelerate launch -m lathe.posttrain.dpo`):
raise the policy's log-likelihood ratio of chosen over rejected replies, relative to a
frozen reference, without a reward model — or, with `loss: simpo | orpo`, the policy's own
length-normalized margin (SimPO) or odds ratio beside the chosen sequences' NLL (ORPO),
with no reference at all (TRL's CPO and ORPO trainers' losses); `loss: kto` learns from
unpaired completions labelled desirable or not (`lathe.posttrain.kto`).

Read top to bottom: config -> runtime -> policy (± LoRA) -> tokenized pairs (prompts fitted
to max_prompt_length) -> the runtime wraps the policy -> reference log-probs, computed once
before any update for every pair the run's steps will draw (not the whole dataset when the
run is shorter than an epoch) and cached with each pair: by the wrapped policy itself
(under LoRA with its adapters disabled), so they share its precision and sharding and no
second copy is loaded, or by a `reference` checkpoint prepared the same way -> loop
(sigmoid, IPO, SimPO or ORPO loss, plus `rpo_alpha` × the chosen replies' NLL; rewards,
margins, accuracy) -> held-out preference
accuracy and task accuracy -> export -> summary.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder
from lathe.data.formats import PreferenceRow, load_preference_dataset, load_unpaired_dataset
from lathe.model.checkpoint import OpenCheckpoint, read_model_config
from lathe.model.config import ModelConfig
from lathe.model.lora import adapters_disabled
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.common import (
    PromptFit,
    ShuffledBatches,
    TaskEvaluator,
    evaluate_task,
    evaluation_cache_bytes,
    finish_stage,
    labelled_logprobs,
    load_policy,
    pad,
    pad_id,
    percent,
    prompt_and_reply,
    rank_batches,
    real_tokens,
    sequence_work,
    stage_history,
    stage_main,
    stage_model,
    stop_reached,
    token_logprobs,
    train_on_batches,
    with_routing,
)
from lathe.posttrain.config import DPOConfig, PreferenceDataConfig, RMConfig
from lathe.posttrain.kto import (
    attach_kto_reference,
    collate_examples,
    kto_objective,
    kto_work,
    tokenize_unpaired,
)
from lathe.posttrain.tool_episodes import EpisodeRunner
from lathe.pretrain.runtime.memory_plan import Parallelism, StepShape
from lathe.pretrain.runtime.trainer import LossFn, Runtime


@dataclass
class Pair:
    chosen: tuple[list[int], list[int]]  # ids, labels (-100 on the prompt)
    rejected: tuple[list[int], list[int]]
    reference: tuple[float, float] | None = None  # reference log-probs of chosen, rejected
    margin: float = 0.0  # the row's (reward modelling)


def tokenize_pairs(encoder: ChatEncoder, rows: list[PreferenceRow], max_len: int,
                   fit: PromptFit) -> list[Pair]:
    """Each pair split where its rendered prompt ends (`ChatEncoder.continuation`), the
    prompt fitted to `fit.max_prompt_length` (< max_len), each reply cut to what is left
    of max_len."""
    pairs = []
    for row in rows:
        prompt, chosen = encoder.continuation(row.prompt, row.chosen, row.tools, row.where)
        _, rejected = encoder.continuation(row.prompt, row.rejected, row.tools, row.where)
        prompt = fit(prompt)
        if prompt is not None:
            pairs.append(Pair(prompt_and_reply(prompt, chosen, max_len),
                              prompt_and_reply(prompt, rejected, max_len), margin=row.margin))
    return pairs


def collate_sides(pairs: list[Pair], pad_token: int, device: torch.device) -> dict[str, Any]:
    """Chosen rows then rejected rows, padded together for one forward pass."""
    sides = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    return {"ids": pad([s[0] for s in sides], pad_token).to(device),
            "lengths": [len(s[0]) for s in sides],
            "labels": pad([s[1] for s in sides], IGNORE_INDEX).to(device)}


def collate(pairs: list[Pair], pad_token: int, device: torch.device,
            with_reference: bool = True) -> dict[str, Any]:
    """`collate_sides` with the pairs' cached reference log-probs (unless the loss takes
    none)."""
    if not with_reference:
        return collate_sides(pairs, pad_token, device)
    missing = sum(p.reference is None for p in pairs)
    if missing:
        raise RuntimeError(f"{missing} of {len(pairs)} pairs have no reference log-probs: "
                           "attach_reference must see every pair the run draws")
    return collate_sides(pairs, pad_token, device) | {"reference": torch.tensor(
        [p.reference[0] for p in pairs] + [p.reference[1] for p in pairs], device=device)}


def sequence_logprobs(model: nn.Module, batch: dict[str, Tensor], mean: bool) -> Tensor:
    total, count = token_logprobs(model, batch["ids"], batch["labels"])
    return total / count.clamp(min=1) if mean else total


def rpo_loss(model: nn.Module, batch: dict[str, Tensor], mean: bool, beta: float, kind: str,
             rpo_alpha: float, simpo_gamma: float = 0.5) -> tuple[Tensor, dict[str, Tensor]]:
    """The preference loss `kind` of a batch of pairs (chosen rows, then rejected) on each
    reply's summed or (`mean`) per-token log-prob, plus `rpo_alpha` × the per-token NLL of
    the chosen replies (TRL's rpo_alpha, Pang et al. 2024; CPO's cpo_alpha): DPO alone
    lowers the chosen replies' likelihood too (only the margin must grow), which on
    exact-answer tasks costs accuracy."""
    ids, labels = batch["ids"], batch["labels"]
    replies = labels[:, 1:] != IGNORE_INDEX
    if kind == "orpo":  # one head pass scores every token: the replies and whole chosen rows
        whole = torch.where(real_tokens(batch), ids, IGNORE_INDEX)
        per_token, router = labelled_logprobs(model, batch, whole)
        per_token_replies = per_token * replies
    else:
        per_token_replies, router = labelled_logprobs(model, batch)
    total, count = per_token_replies.sum(-1), replies.sum(-1)
    logps = total / count.clamp(min=1) if mean else total
    if kind == "simpo":
        loss, metrics = simpo_loss(logps, beta, simpo_gamma)
    elif kind == "orpo":
        chosen = slice(0, ids.shape[0] // 2)
        scored = whole[chosen, 1:] != IGNORE_INDEX
        nll = -per_token[chosen].sum() / scored.sum().clamp(min=1)
        loss, metrics = orpo_loss(logps, nll, beta)
    else:
        loss, metrics = dpo_loss(logps, batch["reference"], beta, kind)
    if rpo_alpha:
        chosen_total, chosen_count = total.chunk(2)[0], count.chunk(2)[0]
        nll = -chosen_total.sum() / chosen_count.sum().clamp(min=1)
        loss = loss + rpo_alpha * nll
        metrics |= {"loss": loss, "nll_loss": nll.detach()}
    return with_routing(loss, metrics, router)


REFERENCE_FREE = ("simpo", "orpo")  # losses of the policy's log-probs alone
MEAN_LOGPS = ("ipo", "simpo", "orpo")  # losses of each reply's mean token log-prob (TRL's)


def dpo_loss(policy_logps: Tensor, reference_logps: Tensor, beta: float,
             kind: str = "sigmoid") -> tuple[Tensor, dict[str, Tensor]]:
    """DPO's loss on (2B,) log-probs laid out as B chosen then B rejected.

    sigmoid: -log σ(β·[(π_c − ref_c) − (π_r − ref_r)]) (Rafailov et al.);
    ipo: ([(π_c − ref_c) − (π_r − ref_r)] − 1/(2β))² (Azar et al.).
    """
    chosen, rejected = (policy_logps - reference_logps).chunk(2)
    logits = chosen - rejected
    if kind == "ipo":
        loss = (logits - 1 / (2 * beta)).pow(2).mean()
    else:
        loss = -F.logsigmoid(beta * logits).mean()
    return loss, reward_metrics(loss, beta * chosen.detach(), beta * rejected.detach())


def simpo_loss(policy_logps: Tensor, beta: float, gamma: float) -> tuple[Tensor, dict[str, Tensor]]:
    """SimPO (Meng et al. 2024; TRL's CPO with loss_type="simpo") on (2B,) per-token mean
    log-probs, B chosen then B rejected: −log σ(β·(π_c − π_r) − γ), with no reference."""
    chosen, rejected = policy_logps.chunk(2)
    loss = -F.logsigmoid(beta * (chosen - rejected - gamma / beta)).mean()
    return loss, reward_metrics(loss, beta * chosen.detach(), beta * rejected.detach())


def orpo_loss(policy_logps: Tensor, chosen_nll: Tensor,
              beta: float) -> tuple[Tensor, dict[str, Tensor]]:
    """ORPO (Hong et al. 2024; TRL's ORPOTrainer) on (2B,) per-token mean log-probs log p,
    B chosen then B rejected: the chosen sequences' NLL − β · mean log σ(log odds ratio),
    where a reply's odds are p / (1 − p); no reference."""
    chosen, rejected = policy_logps.float().chunk(2)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    loss = chosen_nll - beta * ratio.mean()
    return loss, reward_metrics(loss, beta * chosen.detach(), beta * rejected.detach()) | {
        "nll_loss": chosen_nll.detach(), "log_odds_ratio": ratio.mean().detach(),
        "log_odds_chosen": log_odds.mean().detach()}


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 − exp(x)) for x < 0, each branch where it keeps its precision (at −ln 2)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def reward_metrics(loss: Tensor, chosen: Tensor, rejected: Tensor) -> dict[str, Tensor]:
    """The loss and the implicit rewards of chosen and rejected replies, as TRL logs them."""
    return {"loss": loss, "rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
            "rewards/margins": (chosen - rejected).mean(),
            "rewards/accuracy": (chosen > rejected).float().mean()}


@torch.no_grad()
def attach_reference(model: nn.Module, pairs: list[Pair], mean: bool, micro_batch: int,
                     pad_token: int, device: torch.device) -> None:
    """Cache the reference's log-probs with each pair. Every rank runs every batch, so a
    sharded reference (whose forward is collective) sees the same calls on each rank."""
    was_training = model.training
    model.eval()
    for start in range(0, len(pairs), micro_batch):
        chunk = pairs[start:start + micro_batch]
        logps = sequence_logprobs(model, collate_sides(chunk, pad_token, device), mean).tolist()
        for pair, chosen, rejected in zip(chunk, logps[:len(chunk)], logps[len(chunk):],
                                          strict=True):
            pair.reference = (chosen, rejected)
    model.train(was_training)


def reference_model(runtime: Runtime, config: DPOConfig) -> contextlib.AbstractContextManager:
    """The reference, in the policy's precision and sharding: before any update the prepared
    policy is it (under LoRA with its adapters off), so DPO's first loss is exactly log 2;
    a `reference` checkpoint is loaded and prepared as the policy was."""
    if config.reference is not None:
        return contextlib.nullcontext(runtime.prepare_frozen(
            stage_model(runtime, OpenCheckpoint(config.reference))))
    if config.lora.enabled:
        return _adapters_off(runtime.model)
    return contextlib.nullcontext(runtime.model)


@contextlib.contextmanager
def _adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    with adapters_disabled(model):
        yield model


@torch.no_grad()
def heldout_preference(runtime: Runtime, items: list, micro_batch: int,
                       collated: Callable[[list], dict[str, Any]],
                       objective: LossFn) -> dict[str, float]:
    """Loss and reward accuracy on held-out pairs (or KTO's examples), averaged over ranks
    (collective)."""
    model = runtime.model
    model.eval()
    sums = torch.zeros(3, device=runtime.device)
    for rows, counts in rank_batches(items, micro_batch, runtime.rank, runtime.world_size):
        loss, metrics = objective(model, collated(rows))
        n = len(rows) * counts
        sums += torch.stack([loss * n, metrics["rewards/accuracy"] * n,
                             torch.tensor(float(n), device=runtime.device)])
    model.train()
    sums = runtime.accelerator.reduce(sums, reduction="sum")
    return {"eval/preference_loss": float(sums[0] / sums[2]),
            "eval/preference_accuracy": float(sums[1] / sums[2])}


def step_shape(config: DPOConfig | RMConfig, parallelism: Parallelism,
               model_config: ModelConfig | None = None,
               head: Literal["logprobs", "score"] = "logprobs") -> StepShape:
    """One DPO micro-batch, for memory plans: a pair is two rows (chosen, rejected) of up
    to data.max_len tokens through per-token log-probs (a reward model's: its score head).
    The reference's log-probs are cached before training and it is released, so it holds
    nothing during steps."""
    model_config = model_config or read_model_config(config.model)
    return StepShape(2 * config.micro_batch_size, config.data.max_len, head,
                     config.grad_accum_steps, evaluation_bytes=evaluation_cache_bytes(
                         model_config, parallelism.mixed_precision))


def preference_fit(data: PreferenceDataConfig, context: int) -> PromptFit:
    """How `data`'s prompts are fitted: below data.max_len, itself within the model's
    `context`."""
    fit = PromptFit(data.max_prompt_length or data.max_len // 2, data.prompt_overflow)
    if fit.max_prompt_length >= data.max_len or data.max_len > context:
        raise ConfigError(f"data.max_prompt_length={fit.max_prompt_length} must be below "
                          f"data.max_len={data.max_len}, itself at most the model's "
                          f"max_seq_len={context}")
    return fit


def require_examples(train: list, data: PreferenceDataConfig, fit: PromptFit) -> None:
    """Refuse a training set that fitting emptied."""
    if not train:
        raise ConfigError(f"data.train={data.train!r}: every prompt is over "
                          f"max_prompt_length={fit.max_prompt_length} and was dropped; raise "
                          "data.max_prompt_length or set data.prompt_overflow=truncate_left")


def dpo(config: DPOConfig, resume: str = "never") -> dict[str, Any]:
    runtime = Runtime(config, stage="dpo")
    model, encoder = load_policy(runtime, config)
    model_config = model.config
    data, pad_token = config.data, pad_id(encoder.tokenizer)
    mean, reference_free = config.loss in MEAN_LOGPS, config.loss in REFERENCE_FREE
    kto = config.loss == "kto"
    fit = preference_fit(data, model_config.max_seq_len)

    def tokenized(source: str, split: str, limit: int | None, fit: PromptFit) -> list:
        if kto:
            return tokenize_unpaired(encoder, load_unpaired_dataset(source, split, limit),
                                     data.max_len, fit)
        return tokenize_pairs(encoder, load_preference_dataset(source, split, limit),
                              data.max_len, fit)

    train = tokenized(data.train, "train", data.limit, fit)
    require_examples(train, data, fit)
    heldout = tokenized(data.eval or data.train, "test",
                        config.eval.batches * config.micro_batch_size,
                        PromptFit(fit.max_prompt_length, fit.overflow))

    batches = ShuffledBatches(train, config.micro_batch_size, config.seed, runtime.rank,
                              runtime.world_size)
    mean_len = sum(len(e.side[0]) + len(e.mismatched[0]) if kto else
                   len(e.chosen[0]) + len(e.rejected[0]) for e in train) / len(train)
    tokens_per_step = int(config.micro_batch_size * config.grad_accum_steps
                          * runtime.world_size * mean_len)
    total_steps = config.total_steps(tokens_per_step, model_config.num_params())
    runtime.prepare(model, total_steps, step_shape(config, runtime.parallelism, model_config))
    # only the pairs this run's steps draw: a run shorter than an epoch needs no more
    drawn = batches.drawn_by(total_steps * config.grad_accum_steps)
    if not reference_free:
        with reference_model(runtime, config) as reference, runtime.autocast():
            if kto:
                attach_kto_reference(reference, drawn + heldout, config.micro_batch_size,
                                     pad_token, runtime.device)
            else:
                attach_reference(reference, drawn + heldout, mean, config.micro_batch_size,
                                 pad_token, runtime.device)
    restored = runtime.start(config, resume)
    if restored is not None:
        batches.load_state_dict(restored["batches"])
    evaluator = TaskEvaluator(config.task_eval, config.model, encoder,
                              EpisodeRunner(encoder, config.tools))
    what = (f"{len(train):,} examples ({sum(e.desirable for e in train):,} desirable)"
            if kto else f"{len(train):,} pairs")
    runtime.print(f"dpo: {what}, {len(heldout)} held out, beta {config.beta}, "
                  f"{config.loss} loss"
                  + (f" + {config.rpo_alpha} × chosen NLL" if config.rpo_alpha else "")
                  + f", {total_steps} steps; "
                  + ("no reference model" if reference_free else
                     f"reference log-probs cached for the {len(drawn):,} "
                     f"{'examples' if kto else 'pairs'} they draw"
                     + (" (adapters disabled)" if config.lora.enabled else ""))
                  + f"; {encoder.name}; {fit.report()}")

    def collated(rows: list) -> dict[str, Any]:
        if kto:
            return collate_examples(rows, pad_token, runtime.device)
        return collate(rows, pad_token, runtime.device, not reference_free)

    def loss_fn(m: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        if kto:
            return kto_objective(m, batch, config.beta, config.desirable_weight,
                                 config.undesirable_weight,
                                 lambda t: runtime.accelerator.reduce(t, reduction="mean"))
        return rpo_loss(m, batch, mean, config.beta, config.loss, config.rpo_alpha,
                        config.simpo_gamma)

    history = stage_history(restored, "preference_accuracy", "accuracy")

    def evaluate() -> bool:
        metrics = heldout_preference(runtime, heldout, config.micro_batch_size, collated,
                                     loss_fn)
        accuracy = evaluate_task(runtime, evaluator, config.lora)
        runtime.log(metrics)
        history["preference_accuracy"].append(metrics["eval/preference_accuracy"])
        history["accuracy"].append(accuracy)
        runtime.print(f"step {runtime.step}: held-out preference accuracy "
                      f"{metrics['eval/preference_accuracy']:.1%} (loss "
                      f"{metrics['eval/preference_loss']:.4f}), {config.task_eval.task} accuracy "
                      f"{percent(accuracy)}")
        return stop_reached(runtime, config.task_eval, accuracy)

    if restored is None:
        evaluate()
    train_on_batches(runtime, config, batches, collated, loss_fn,
                     lambda batch: kto_work(model_config, batch) if kto else sequence_work(
                         model_config, batch["lengths"], len(batch["lengths"]) // 2),
                     evaluate, history)

    summary = finish_stage(runtime, config, model_config, history,
                           ["preference_accuracy", "accuracy"], {"prompt_fit": fit.counts()})
    if runtime.is_main:
        print(f"done: dpo {runtime.step} steps in {summary['seconds']:.0f}s; held-out preference "
              f"accuracy {history['preference_accuracy'][0]:.1%} -> "
              f"{history['preference_accuracy'][-1]:.1%}, task accuracy "
              f"{percent(history['accuracy'][0])} -> {percent(history['accuracy'][-1])}\n"
              f"checkpoint: {summary['final']}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    return stage_main("dpo", "Direct preference optimization on (prompt, chosen, rejected) pairs.",
                      DPOConfig, dpo, argv)


if __name__ == "__main__":
    import sys

    from lathe.core.cli import exit_process, run_command
    exit_process(run_command("dpo", sys.argv[1:]))
