"""What every post-training stage shares: loading the policy (optionally with LoRA),
fitting prompts into the context, resumable shuffled batches of examples, what each
micro-batch computes (loss units, tokens, FLOPs), per-token log-probabilities, held-out
task accuracy by generation with the serve engine, and the final export."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from lathe.core.atomic import write_json
from lathe.core.checkpoint_files import read_eos_ids
from lathe.core.config import load_config, to_dict
from lathe.core.errors import ConfigError
from lathe.data.chat_encoding import ChatEncoder, chat_encoder
from lathe.data.chat_template import read_template_file
from lathe.data.formats import load_prompt_dataset
from lathe.model.checkpoint import OpenCheckpoint, load_checkpoint, save_checkpoint
from lathe.model.config import ModelConfig
from lathe.model.head_ops import LabelLogprobs
from lathe.model.lora import LoraSection, apply_lora, load_adapter, merge_lora, save_adapter
from lathe.model.transformer import (
    IGNORE_INDEX,
    RouterStats,
    Transformer,
    routing_metrics,
    with_router_losses,
)
from lathe.posttrain.config import PosttrainConfig, TaskEvalConfig
from lathe.posttrain.rewards import verifier
from lathe.posttrain.tool_episodes import EpisodePrompt, EpisodeRunner
from lathe.pretrain.runtime.memory_plan import memory_line
from lathe.pretrain.runtime.precision import compute_dtype
from lathe.pretrain.runtime.trainer import Runtime, Work, plain_model
from lathe.serve.config import EngineConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.paged_cache import engine_cache_bytes
from lathe.serve.sampling_params import SamplingParams

T = TypeVar("T")


def load_policy(runtime: Runtime, config: PosttrainConfig,
                opened: OpenCheckpoint | None = None) -> tuple[Transformer, ChatEncoder]:
    """The starting weights in fp32 (the runtime applies mixed precision), with the balance
    loss of its experts weighted as the stage says (`balance_experts`) and adapters injected
    when LoRA is enabled, and the stage's chat encoder: the checkpoint's tokenizer
    with the chat template it trains on (`chat_template`, or the checkpoint's own).
    `opened`: `config.model` already open, when the stage builds more models from it."""
    checkpoint, lora = config.model, config.lora
    if lora.qlora and runtime.sharded:
        raise ConfigError(f"lora.qlora=true on a {runtime.setup['distributed_type']} launch: "
                          "its 4-bit base cannot be sharded or gathered here; run QLoRA on a "
                          "single-process or DDP launch (recipes/accelerate/gpu.yaml)")
    encoder = chat_encoder(checkpoint, config.chat_template, config.chat_template_kwargs)
    model = stage_model(runtime, opened or OpenCheckpoint(checkpoint))
    balance_experts(model.config, config)
    if lora.enabled:
        apply_lora(model, lora)
    return model.train(), encoder


def stage_model(runtime: Runtime, opened: OpenCheckpoint,
                num_labels: int | None = None) -> Transformer:
    """A model a stage trains or holds frozen (its policy, reference or teacher) in fp32, as
    this rank of the launch holds it until it is wrapped (`Runtime.build_model`: on sharded
    launches only the main process reads the weights)."""
    return runtime.build_model(opened.config_for(num_labels), lambda: opened.model(
        dtype=torch.float32, num_labels=num_labels))


def balance_experts(model_config: ModelConfig, config: PosttrainConfig) -> None:
    """Set whether and how much a mixture of experts' balance loss weighs in the stage's
    loss, as TRL's trainers do: `router_aux_loss_coef`, or unset the checkpoint's own where
    the stage adds it by default (SFT, DPO, GRPO), 0 turning it off. TRL writes the choice
    into the config it saves (`output_router_logits`), and so does the export."""
    coef = config.router_aux_loss_coef
    if coef and (model_config.n_experts is None or model_config.sigmoid_router):
        what = ("no experts" if model_config.n_experts is None else
                "a sigmoid router, whose families have no balance loss (their experts balance "
                "by router_bias_update_speed)")
        raise ConfigError(f"router_aux_loss_coef={coef}: {config.model} has {what}; drop it")
    if model_config.n_experts is None:
        return
    if coef is None:
        coef = model_config.router_aux_loss_coef if config.balances_by_default() else 0.0
    model_config.router_aux_loss = coef != 0 and not model_config.sigmoid_router
    model_config.router_aux_loss_coef = coef


def real_tokens(batch: dict[str, Any]) -> Tensor:
    """(B, T) True at a right-padded batch's real tokens: each row's first `row_lengths`
    (a packed batch's) or `lengths`."""
    ids = batch["ids"]
    lengths = torch.as_tensor(batch.get("row_lengths", batch["lengths"]), device=ids.device)
    return torch.arange(ids.shape[1], device=ids.device) < lengths[:, None]


def pad_id(tokenizer: Tokenizer) -> int:
    token = tokenizer.token_to_id("<|pad|>")
    return token if token is not None else 0


class ShuffledBatches(Generic[T]):
    """Examples in a seeded order per epoch; each step takes micro_batch × world examples
    and this rank keeps its share. `state_dict()` is (epoch, index): exact resume."""

    def __init__(self, examples: Sequence[T], micro_batch: int, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        if len(examples) < micro_batch * world_size:
            raise ConfigError(f"{len(examples)} examples cannot fill one step of "
                              f"micro_batch_size={micro_batch} × {world_size} ranks: add "
                              "examples or lower micro_batch_size")
        self.examples, self.micro_batch, self.seed = examples, micro_batch, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.index = 0, 0
        self._drawn_order: tuple[int, list[int]] | None = None  # (epoch, its order)

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        return torch.randperm(len(self.examples), generator=g).tolist()

    def _epoch_order(self) -> list[int]:
        """`_order(self.epoch)`, shuffled once an epoch rather than once a step."""
        if self._drawn_order is None or self._drawn_order[0] != self.epoch:
            self._drawn_order = (self.epoch, self._order(self.epoch))
        return self._drawn_order[1]

    def _advance(self) -> list[int]:
        """The indices of the next step's examples, all ranks' shares in rank order."""
        step = self.micro_batch * self.world_size
        if self.index + step > len(self.examples):
            self.epoch, self.index = self.epoch + 1, 0
        order = self._epoch_order()[self.index:self.index + step]
        self.index += step
        return order

    def next(self) -> list[T]:
        order = self._advance()
        mine = order[self.rank * self.micro_batch:(self.rank + 1) * self.micro_batch]
        return [self.examples[i] for i in mine]

    def drawn_by(self, micro_batches: int) -> list[T]:
        """Every example, on all ranks and each once, that the first `micro_batches` calls
        of `next` of a fresh run draw: all a run of that length (resumed or not) trains on."""
        probe = ShuffledBatches(self.examples, self.micro_batch, self.seed, 0, self.world_size)
        drawn: dict[int, None] = {}
        for _ in range(micro_batches):
            if len(drawn) == len(self.examples):
                break
            drawn.update(dict.fromkeys(probe._advance()))
        return [self.examples[i] for i in drawn]

    def taken(self) -> list[T]:
        """Every example the steps so far drew, on all ranks (an epoch ends where the next
        step would not fit)."""
        whole = len(self.examples) // (self.micro_batch * self.world_size) \
            * self.micro_batch * self.world_size
        return [self.examples[i] for epoch in range(self.epoch + 1)
                for i in self._order(epoch)[:self.index if epoch == self.epoch else whole]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


def stage_history(restored: dict[str, Any] | None, *keys: str) -> dict[str, list[float]]:
    """A stage's record of its evaluations, one list per key: empty on a fresh start, or
    as saved with the state a resumed run starts from — so that the summary of a run that
    was killed and resumed still holds the evaluations from before the kill."""
    saved = (restored or {}).get("history", {})
    return {key: list(saved.get(key, [])) for key in keys}


def train_on_batches(runtime: Runtime, config: PosttrainConfig, batches: ShuffledBatches,
                     collate: Callable[[list], Any], loss_fn: Callable,
                     work_of: Callable[[Any], Work], evaluate: Callable[[], bool],
                     history: dict[str, list[float]]) -> None:
    """The supervised loop SFT, DPO and distillation share: accumulate micro-batches, step,
    evaluate and save state on their cadences (the batch position and the evaluation
    `history` are the resume state). The loop ends early when `evaluate` says so
    (`stop_reached`)."""
    while runtime.step < runtime.total_steps:
        micro = [collate(batches.next()) for _ in range(config.grad_accum_steps)]
        runtime.log_step(runtime.train_step(micro, loss_fn, work_of))
        if runtime.should(config.eval.every):
            with runtime.throughput.paused():
                if evaluate():
                    return
        if runtime.should(config.checkpoint.every):
            runtime.save({"batches": batches.state_dict(), "history": history})


def sequence_work(model_config: ModelConfig, lengths: Sequence[int], units: float) -> Work:
    """A micro-batch of sequences with `lengths` real tokens whose loss is a mean over
    `units`: its tokens, and the FLOPs of a forward + backward pass over them (padding is
    not counted: MFU counts the model's useful work)."""
    flops = sum(n * model_config.flops_per_token(n) for n in lengths)
    return Work(units=float(units), tokens=sum(lengths), flops=flops)


def prompt_and_reply(prompt: list[int], reply: list[int],
                     max_len: int) -> tuple[list[int], list[int]]:
    """A prompt and one reply as (ids, labels), labels -100 on the prompt, cut to max_len."""
    return (prompt + reply)[:max_len], ([IGNORE_INDEX] * len(prompt) + reply)[:max_len]


def label_count(labels: Tensor) -> int:
    """How many positions of an (N, T) label batch are scored (position t predicts t + 1)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


@dataclass
class PromptFit:
    """How a dataset's prompts fit `max_prompt_length`: each longer one is cut from the
    left (keeping the question and the assistant header) or dropped, per `overflow`."""

    max_prompt_length: int
    overflow: str  # "truncate_left" | "drop"
    kept: int = 0
    truncated: int = 0
    dropped: int = 0

    def __call__(self, ids: list[int]) -> list[int] | None:
        if len(ids) <= self.max_prompt_length:
            self.kept += 1
            return ids
        if self.overflow == "drop":
            self.dropped += 1
            return None
        self.truncated += 1
        return ids[len(ids) - self.max_prompt_length:]

    def report(self) -> str:
        return (f"prompts over max_prompt_length={self.max_prompt_length}: {self.truncated} "
                f"truncated on the left, {self.dropped} dropped, {self.kept} fit")

    def counts(self) -> dict[str, int]:
        return {"kept": self.kept, "truncated": self.truncated, "dropped": self.dropped}


def rank_batches(items: Sequence[T], micro_batch: int, rank: int,
                 world_size: int) -> list[tuple[list[T], bool]]:
    """This rank's share of `items` in micro-batches, as many batches on every rank (a
    sharded model's forward is collective, so a rank with one batch fewer would hang the
    others): (batch, counts); a rank with nothing left runs a stand-in that does not count."""
    per_rank = -(-len(items) // world_size)
    mine = list(items[rank * per_rank:(rank + 1) * per_rank])
    batches = []
    for start in range(0, per_rank, micro_batch):
        chunk = mine[start:start + micro_batch]
        batches.append((chunk, True) if chunk else (list(items[:1]), False))
    return batches


def pad(rows: Sequence[Sequence[int]], value: int) -> Tensor:
    """Right-pad token rows into one (B, T) tensor."""
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows])


def labelled_logprobs(model: nn.Module, batch: dict[str, Any], labels: Tensor | None = None,
                      temperature: float = 1.0) -> tuple[Tensor, RouterStats | None]:
    """log p(label_t | tokens < t) per position of a collated batch (0 where unlabelled;
    `labels`, default the batch's), from logits / `temperature`, and a mixture of experts'
    routing over the batch's real tokens, whose router losses a stage's own loss adds
    (`with_routing`) when it trains."""
    op = LabelLogprobs(batch["labels"] if labels is None else labels, temperature)
    out = model(batch["ids"], head_op=op, token_mask=real_tokens(batch))
    return out.head, out.router


def with_routing(loss: Tensor, metrics: dict[str, Tensor], router: RouterStats | None
                 ) -> tuple[Tensor, dict[str, Tensor]]:
    """A stage's own loss (DPO's, KTO's, GRPO's) plus a mixture of experts' router losses,
    as TRL's trainers add them, and its metrics with the routing's (`routing_metrics`)."""
    if router is None:
        return loss, metrics
    loss = with_router_losses(loss, router)
    return loss, {**metrics, "loss": loss, **routing_metrics(router)}


def token_logprobs(model: nn.Module, input_ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sequence sum of log p(label) over labelled positions, and their count.

    `labels` align with `input_ids` (position t is predicted from tokens < t); -100 skips.
    """
    picked = model(input_ids, head_op=LabelLogprobs(labels)).head
    return picked.sum(-1), (labels[:, 1:] != IGNORE_INDEX).sum(-1)


def generation_model(runtime: Runtime, lora: LoraSection) -> Transformer | None:
    """The policy as a single-device module for the serve engine, on the main process
    (None elsewhere). Sharded launches gather the weights first (collective)."""
    accelerator = runtime.accelerator
    if not runtime.sharded:
        return accelerator.unwrap_model(runtime.model) if runtime.is_main else None
    state = accelerator.get_state_dict(runtime.model)
    if not runtime.is_main:
        return None
    model = accelerator.unwrap_model(runtime.model)
    return plain_model(model.config, state, lora=lora if lora.enabled else None).to(
        runtime.device)


EVAL_BLOCKS = 512  # the task evaluator's KV cache, in blocks of EngineConfig.block_size


def evaluation_cache_bytes(model_config: ModelConfig, mixed_precision: str) -> int:
    """The task evaluator's KV cache (its one allocation beyond the policy's weights; with
    linear-attention layers, their states)."""
    return engine_cache_bytes(EngineConfig(num_blocks=EVAL_BLOCKS), model_config,
                              compute_dtype(mixed_precision))


class TaskEvaluator:
    """Greedy accuracy of the policy on held-out prompts, generated by the serve engine
    as episodes (`episodes`: with the stage's tools, each turn's calls run and answered).
    With `task_eval.examples` 0 there are no prompts and the evaluation is off."""

    def __init__(self, config: TaskEvalConfig, checkpoint: str, encoder: ChatEncoder,
                 episodes: EpisodeRunner) -> None:
        self.config, self.episodes = config, episodes
        self.rows = [dataclasses.replace(row, tools=row.tools or episodes.definitions())
                     for row in load_prompt_dataset(config.prompts, split="test",
                                                    limit=config.examples)
                     ] if config.examples else []
        self.encoder = encoder
        self.tokenizer = encoder.tokenizer
        self.eos = read_eos_ids(checkpoint,
                                self.tokenizer.get_vocab_size(with_added_tokens=True))
        self.correct = verifier(config.task)

    @torch.no_grad()  # not inference_mode, which FP8 policies fail under (see the engine)
    def __call__(self, model: nn.Module, kv_dtype: torch.dtype | None = None) -> dict[str, Any]:
        was_training = model.training
        config = EngineConfig(num_blocks=EVAL_BLOCKS, retain_freed_memory=False)
        engine = LLMEngine(model.eval(), self.tokenizer, config, self.eos, kv_dtype=kv_dtype)
        prompts = [EpisodePrompt(self.encoder.prompt(row.prompt, row.tools), row.prompt,
                                 row.tools) for row in self.rows]
        params = SamplingParams(max_tokens=self.config.max_tokens, temperature=0)
        episodes = [group[0] for group in self.episodes.run(engine, prompts,
                                                            [params] * len(prompts))]
        model.train(was_training)
        scores = [self.correct(e.answer, row.reference) for e, row in
                  zip(episodes, self.rows, strict=True)]
        return {"accuracy": sum(scores) / len(scores),
                "samples": [(row.prompt[-1]["content"], e.transcript())
                            for row, e in zip(self.rows[:3], episodes[:3], strict=True)]}


def evaluate_task(runtime: Runtime, evaluator: TaskEvaluator, lora: LoraSection) -> float:
    """Held-out accuracy, logged as eval/accuracy with a few samples (collective); NaN,
    logged nowhere, when the evaluation is off."""
    if not evaluator.rows:
        return math.nan
    model = generation_model(runtime, lora)
    accuracy = math.nan
    if model is not None:
        with runtime.autocast():
            result = evaluator(model, runtime.compute_dtype)
        accuracy = result["accuracy"]
        runtime.metrics.log_texts("eval/samples", result["samples"], runtime.step)
    accuracy = float(runtime.accelerator.reduce(
        torch.tensor(accuracy if runtime.is_main else 0.0, device=runtime.device),
        reduction="sum"))
    runtime.log({"eval/accuracy": accuracy})
    return accuracy


def percent(accuracy: float) -> str:
    """An accuracy for the console: "off" for an evaluation that did not run."""
    return "off" if math.isnan(accuracy) else f"{accuracy:.1%}"


def stop_reached(runtime: Runtime, task_eval: TaskEvalConfig, accuracy: float) -> bool:
    """Whether to stop now: held-out accuracy has reached `task_eval.stop_at` (said once,
    on rank 0). With `cooldown_steps` the first time begins the runtime's cooldown instead,
    and the loop ends where it does. The evaluation before the first step is the baseline
    and does neither. Every rank decides alike: `evaluate_task` reduces the accuracy over
    ranks."""
    if (task_eval.stop_at is None or runtime.step == 0 or runtime.cooldown is not None
            or not accuracy >= task_eval.stop_at):
        return False
    reached = (f"step {runtime.step}: held-out {task_eval.task} accuracy {accuracy:.1%} "
               f"reached task_eval.stop_at={task_eval.stop_at:g}")
    if task_eval.cooldown_steps and runtime.step < runtime.total_steps:
        runtime.begin_cooldown(task_eval.cooldown_steps)
        runtime.print(f"{reached}; the learning rate falls to the schedule's floor over "
                      f"{runtime.total_steps - runtime.step} steps (task_eval.cooldown_steps), "
                      f"then the run stops at step {runtime.total_steps}")
        return False
    runtime.print(f"{reached}; stopping before max_steps={runtime.total_steps}")
    return True


def export_policy(runtime: Runtime, config: PosttrainConfig, model_config: ModelConfig,
                  extra: dict[str, Any]) -> Path:
    """The HF checkpoint at out_dir/final (LoRA: merged, adapter beside it), carrying the
    chat template the stage trained on. A QLoRA adapter is merged into the full-precision
    base, never into its 4-bit copy."""
    final = Path(config.out_dir) / "final"
    checkpoint, lora = config.model, config.lora
    provenance = {"config": to_dict(config), "base": checkpoint, **extra}
    template = read_template_file(config.chat_template) if config.chat_template else None
    if not lora.qlora:
        runtime.export(model_config, final, Path(checkpoint), provenance,
                       lora=lora if lora.enabled else None, base=Path(checkpoint),
                       chat_template=template)
        return final
    adapter = final.with_name(final.name + "-adapter")
    if runtime.is_main:
        save_adapter(runtime.accelerator.unwrap_model(runtime.model), lora, adapter, checkpoint)
        merged = merge_lora(load_adapter(load_checkpoint(checkpoint), adapter))
        save_checkpoint(merged, final, tokenizer=Path(checkpoint), provenance={
            "stage": runtime.stage, "steps": runtime.step, **provenance},
            chat_template=template)
    runtime.accelerator.wait_for_everyone()
    return final


def finish_stage(runtime: Runtime, config: PosttrainConfig, model_config: ModelConfig,
                 history: dict[str, list[float]], exported: Sequence[str],
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Export out_dir/final (its provenance: the last value of each `exported` history
    entry), close the run, and write and return the summary: steps, seconds, tokens
    trained on, the final checkpoint, the whole history, `extra` and the parallel setup."""
    memory = runtime.memory_report()  # the steps' peak, before the export gathers weights
    final = export_policy(runtime, config, model_config,
                          {key: history[key][-1:] for key in exported})
    seconds = runtime.finish()
    runtime.print(memory_line(memory))
    summary = {"steps": runtime.step, "seconds": round(seconds, 1), "seed": config.seed,
               "tokens_seen": runtime.tokens_seen, "final": str(final),
               "task": config.task_eval.task, **history,
               **(extra or {}), "parallel": runtime.setup, "memory": memory}
    if runtime.is_main:
        write_json(Path(config.out_dir) / "summary.json", summary)
    return summary


def stage_main(stage: str, description: str, config_cls: type, run: Callable[..., Any],
               argv: Sequence[str] | None) -> int:
    """The command line every stage shares: `--config` recipe, `--resume`, and dotted
    overrides of any config field."""
    parser = argparse.ArgumentParser(
        prog=f"lathe {stage}",
        description=f"{description} Override any field with --dotted.key=value.")
    parser.add_argument("--config", type=Path,
                        help=f"YAML recipe, e.g. recipes/{stage}/e2e.yaml")
    parser.add_argument("--resume", default="never", help="never, auto, or a state folder")
    args, rest = parser.parse_known_args(argv)
    run(load_config(config_cls, args.config, rest), resume=args.resume)
    return 0
