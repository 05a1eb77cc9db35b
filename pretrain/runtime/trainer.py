"""The training runtime every lathe training stage runs on.

`Runtime` builds the Accelerator for the current launch (checked by `launch`), applies
the model converters (FP8, activation checkpointing, compile), builds the optimizers and
lets accelerate wrap everything for DDP, FSDP2 or DeepSpeed. It then owns one optimizer
step — gradient accumulation, clipping, the LR schedule —, saving and resuming the
training state, metrics and the progress bar, and the final export of an HF-layout
checkpoint gathered from whatever shards the parallel setup left. A stage supplies only
its model, its batches and its loss function.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType, set_seed
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch import Tensor, nn

from lathe.core.config import to_dict
from lathe.core.errors import ConfigError
from lathe.core.failpoints import check_env, failpoint
from lathe.core.reporting import default_wandb_offline, progress_bar
from lathe.model.checkpoint import save_checkpoint, skeleton
from lathe.model.config import ModelConfig
from lathe.model.lora import LoraSection, apply_lora, merge_lora, save_adapter
from lathe.model.transformer import Transformer
from lathe.pretrain.runtime import state as training_state
from lathe.pretrain.runtime.config import TrainConfig
from lathe.pretrain.runtime.converters import apply_converters
from lathe.pretrain.runtime.launch import build_accelerator, describe
from lathe.pretrain.runtime.memory_plan import (
    MemoryPlan,
    Parallelism,
    PlanError,
    StepShape,
    deepspeed_buckets,
    parallelism_of_setup,
    plan_memory,
)
from lathe.pretrain.runtime.monitor import (
    MetricsLog,
    PeakMemory,
    Throughput,
    memory_stats,
    peak_flops,
)
from lathe.pretrain.runtime.optim import build_optimizers
from lathe.pretrain.runtime.precision import compute_dtype, default_mixed_precision
from lathe.pretrain.runtime.schedule import lr_factor

# loss_fn(model, batch) -> (the batch's loss as a mean over its Work.units, metrics that are
# means over the same units)
LossFn = Callable[[nn.Module, Any], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class Work:
    """What one micro-batch holds, known before its forward: `units` are what its loss is a
    mean over (label tokens, sequences, pairs, or Dr. GRPO's constant per sequence),
    `tokens` the real (unpadded) tokens it trains on, `flops` the model FLOPs its forward
    and backward take (`ModelConfig.flops_per_token` per token)."""

    units: float
    tokens: int
    flops: float


@dataclass
class StepResult:
    lr: float
    grad_norm: float | None
    metrics: dict[str, Tensor | float]  # tensors on any device, or plain numbers


def _no_gpu_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Setting accelerator to CPU")


_SHARED_TENSOR_NOTICE = re.compile(r"Removed shared tensor \{(.*)\} while saving")


def _no_tied_head_notice(record: logging.LogRecord) -> bool:
    """False for accelerate's notice, at every `save_state`, that it dropped the LM head
    tied to the embedding: the tie is the model's (`tie_word_embeddings`) and loading the
    embedding restores it. A notice naming any other shared tensor still shows."""
    found = _SHARED_TENSOR_NOTICE.search(record.getMessage())
    return found is None or not all(
        name.strip().strip("'\"").endswith("lm_head.weight")
        for name in found.group(1).split(","))


class Runtime:
    def __init__(self, config: TrainConfig, stage: str) -> None:
        self.config, self.stage = config, stage
        check_env()
        if not torch.cuda.is_available():
            # accelerate imports DeepSpeed when it unwraps a model, and DeepSpeed then says it
            # "was unable to detect" a GPU. Naming the CPU (DS_ACCELERATOR=cpu) would silence
            # it but switches DeepSpeed to a shared-memory all-reduce that aborts its process
            # at exit, so the notice is filtered instead (DeepSpeed reuses this logger).
            logging.getLogger("DeepSpeed").addFilter(_no_gpu_notice)
        logging.getLogger("accelerate.utils.other").addFilter(_no_tied_head_notice)
        self.out_dir = Path(config.out_dir)
        use_wandb = config.logging.report_to == "wandb"
        if use_wandb:
            default_wandb_offline()
        self.accelerator = build_accelerator(
            mixed_precision=config.precision.mixed_precision or default_mixed_precision(),
            gradient_accumulation_steps=config.grad_accum_steps,
            log_with="wandb" if use_wandb else None,
            project_dir=str(self.out_dir),
        )
        self.setup = describe(self.accelerator)
        self.compute_dtype = compute_dtype(self.accelerator.mixed_precision)
        self.device = self.accelerator.device
        self.is_main = self.accelerator.is_main_process
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", self.accelerator)
        self.model: nn.Module | None = None
        self.optimizers: list = []
        self.converters: dict = {}
        self.total_steps = self.planned_steps = 0  # the run's end, and the schedule's
        self.cooldown: tuple[int, int] | None = None  # (start, end) once begun
        self.step = 0
        self.tokens_seen = 0
        self._progress: Any = None  # the rank-0 progress bar
        self.plan: MemoryPlan | None = None
        self.peak_memory = PeakMemory(self.device)
        self.peak_memory.start()  # before the stage loads any weight
        set_seed(config.seed)

    # -- setup ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    def prepare(self, model: Transformer, total_steps: int,
                shape: StepShape | None = None) -> None:
        """Print the memory plan of a micro-batch of `shape` (a stage's), convert, build
        optimizers, wrap for the launch's parallelism, start throughput."""
        self.total_steps = self.planned_steps = total_steps
        if self.is_main and shape is not None:
            self._print_plan(model, shape)
        self.converters = apply_converters(model, self.config.precision, self.device)
        if "fp8_not_experts" in self.converters:
            self.print(f"fp8: {self.converters['fp8_not_experts']}")
        optimizers = build_optimizers(model, self.config.optim, self.device.type)
        kind = self.accelerator.distributed_type
        if len(optimizers) > 1 and kind in (DistributedType.DEEPSPEED, DistributedType.FSDP):
            raise ConfigError(
                f"optim.name=muon needs whole matrices on every rank, but this launch is "
                f"{kind.value}, which shards them; use a DDP or single-process launch config, "
                "or optim.name=adamw")
        if kind is DistributedType.DEEPSPEED:
            self._configure_deepspeed(model.config.dim)
        prepared = self.accelerator.prepare(model, *optimizers)
        self.model, self.optimizers = prepared[0], list(prepared[1:])
        peak, self.peak_source = peak_flops(self.device, fp8=self.config.precision.fp8)
        self.throughput = Throughput(peak * self.world_size)

    def _print_plan(self, model: Transformer, shape: StepShape) -> None:
        try:
            plan = self.memory_plan(model.config, shape)
        except PlanError as error:  # a plan informs; it never stops a run
            self.print(f"memory plan: {error}")
            return
        if self.device.type == "cpu":  # the host's data shares the device's memory here
            tensors = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
            plan = dataclasses.replace(plan, host=max(
                self.peak_memory.resident() - tensors - shape.frozen_bytes, 0))
        self.plan = plan
        self.print(plan.table())

    @property
    def parallelism(self) -> Parallelism:
        """This launch as a memory plan sees it."""
        return parallelism_of_setup(self.setup, self.device.type)

    def memory_plan(self, model_config: ModelConfig, shape: StepShape) -> MemoryPlan:
        """What one step of this launch holds per rank (`lathe.pretrain.runtime.memory_plan`),
        traced without touching this process's random streams."""
        precision = self.config.precision
        with torch.random.fork_rng(devices=[]):
            return plan_memory(model_config, shape, self.parallelism,
                               lora=getattr(self.config, "lora", None),
                               activation_checkpointing=precision.activation_checkpointing,
                               z_loss=precision.z_loss)

    def memory_report(self) -> dict[str, float]:
        """The largest peak of any rank against the plan (GiB; collective)."""
        peak = torch.tensor([float(self.peak_memory.peak())], device=self.device)
        peak = float(self.accelerator.gather(peak).max())
        report: dict[str, float] = {"peak_gib": round(peak / 2**30, 3)}
        if self.plan is not None:
            report["plan_gib"] = round(self.plan.total / 2**30, 3)
        if self.device.type == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            report["allocator_retains"] = True  # the peak counts freed blocks glibc kept
        return report

    def build_model(self, config: ModelConfig, whole: Callable[[], Transformer]) -> Transformer:
        """The model of `config` this rank holds until `prepare` or `prepare_frozen` wraps
        it, with the weights of `whole()` (a checkpoint's, or a new initialization), which
        only the main process calls where the launch allows — so the host holds one full
        copy, not one a rank: on FSDP2 with cpu_ram_efficient_loading the other ranks build
        a skeleton (`lathe.model.checkpoint.skeleton`) and the wrapping sends each its
        shards; on ZeRO-3 with zero3_init_flag every rank builds it partitioned and the main
        process writes each weight in turn (collective). Elsewhere every rank calls it."""
        kind = self.accelerator.distributed_type
        if kind is DistributedType.FSDP and \
                self.accelerator.state.fsdp_plugin.cpu_ram_efficient_loading:
            return whole() if self.is_main else skeleton(config)
        if kind is DistributedType.DEEPSPEED and self.setup.get("zero_stage") == 3 and \
                self.accelerator.state.deepspeed_plugin.zero3_init_flag:
            return self._partitioned(config, whole)
        return whole()

    def _partitioned(self, config: ModelConfig,
                     whole: Callable[[], Transformer]) -> Transformer:
        """A `Transformer` of `config` built under deepspeed.zero.Init — each rank allocates
        only its partition of every weight — holding the weights of `whole()`, which only
        the main process calls; each weight is gathered in turn for it to write, as
        transformers loads a checkpoint under ZeRO-3."""
        import deepspeed  # slow to import, and only DeepSpeed launches need it

        self._configure_deepspeed(config.dim)
        # without the global batch, which zero.Init would check against a world of one
        ds_config = {key: value for key, value in
                     self.accelerator.state.deepspeed_plugin.deepspeed_config.items()
                     if key != "train_batch_size"}
        state = whole().state_dict() if self.is_main else {}
        # the build's own initialization draws nothing from the run's random streams
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), deepspeed.zero.Init(
                config_dict_or_path=ds_config, dtype=torch.float32):
            model = Transformer(config)
        model.tie_weights()
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if self.is_main:
                    param.data.copy_(state[name])
        persistent = set(model.state_dict())
        for name, buffer in model.named_buffers():  # kept whole on every rank
            if name in persistent:
                if self.is_main:
                    buffer.copy_(state[name].to(buffer.device))
                torch.distributed.broadcast(buffer, src=0)
        return model.eval()

    @property
    def sharded(self) -> bool:
        """Whether the prepared model's weights live in FSDP2 or DeepSpeed's keeping, so a
        full copy of them must be gathered (`accelerator.get_state_dict`, collective)."""
        return self.accelerator.distributed_type in (DistributedType.FSDP,
                                                     DistributedType.DEEPSPEED)

    @property
    def shards_weights(self) -> bool:
        """Whether each rank holds only a slice of each weight (FSDP2, ZeRO-3)."""
        kind = self.accelerator.distributed_type
        if kind is DistributedType.DEEPSPEED:
            return self.setup.get("zero_stage") == 3
        return kind is DistributedType.FSDP

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """A frozen model (a DPO/GRPO reference, a distillation teacher) placed, sharded and
        cast as the policy was, so it costs 1/N of its weights per rank and computes in the
        policy's numerics: FSDP2 shards it with the policy's wrap and mixed-precision
        policies; DeepSpeed runs it as an engine without optimizer (ZeRO-3 partitions it;
        other stages only cast it, as TRL does); otherwise it is moved to the device.
        Call its forward under `autocast()`; on sharded launches on every rank."""
        model.requires_grad_(False).eval()
        kind = self.accelerator.distributed_type
        if kind is DistributedType.FSDP:
            if not self.accelerator.state.fsdp_plugin.cpu_ram_efficient_loading:
                model = model.to(self.device)  # else sharded from the main process' CPU copy
            return fsdp2_prepare_model(self.accelerator, model).eval()
        if kind is DistributedType.DEEPSPEED:
            import deepspeed  # slow to import, and only DeepSpeed launches need it

            config = copy.deepcopy(self.accelerator.state.deepspeed_plugin.deepspeed_config)
            for key in ("optimizer", "scheduler"):
                config.pop(key, None)
            zero = config.setdefault("zero_optimization", {})
            if zero.get("stage", 0) != 3:
                zero["stage"] = 0
            zero.pop("offload_optimizer", None)
            engine, *_ = deepspeed.initialize(model=model, config=config)
            engine.eval()  # DeepSpeedEngine.eval returns None
            return engine
        return model.to(self.device)

    def _configure_deepspeed(self, dim: int) -> None:
        """Batch geometry and clipping are the runtime's; DeepSpeed must agree with them.
        Communication buckets a DeepSpeed config leaves unset or "auto" are sized by the
        model (`deepspeed_buckets`), as transformers' Trainer sizes them."""
        ds = self.accelerator.state.deepspeed_plugin.deepspeed_config
        zero = ds.setdefault("zero_optimization", {})
        for key, value in deepspeed_buckets(dim).items():
            if zero.get(key, "auto") == "auto":
                zero[key] = value
        c = self.config
        ds["train_micro_batch_size_per_gpu"] = c.micro_batch_size
        ds["gradient_accumulation_steps"] = c.grad_accum_steps
        ds["train_batch_size"] = c.micro_batch_size * c.grad_accum_steps * self.world_size
        ds["gradient_clipping"] = c.optim.grad_clip or 0.0
        ds["zero_allow_untested_optimizer"] = True  # our torch AdamW, not DeepSpeed's
        ds["steps_per_print"] = 2**31 - 1

    def start(self, run_config: Any, resume: str) -> dict[str, Any] | None:
        """Start trackers and resume if asked; returns the resumed trainer state (or None)."""
        path = training_state.choose_resume(self.accelerator, self.out_dir, resume, self.print)
        restored = None
        if path is not None:
            restored = training_state.load_state(self.accelerator, path)
            self.step, self.tokens_seen = restored["step"], restored["tokens_seen"]
            if restored.get("cooldown") is not None:
                self._set_cooldown(*restored["cooldown"])
        self.metrics.truncate_after(self.step)  # a fresh start keeps no earlier run's records
        if self.config.logging.report_to == "wandb":
            logging = self.config.logging
            self.accelerator.init_trackers(
                logging.project, config=to_dict(run_config),
                init_kwargs={"wandb": {"name": logging.run_name or self.out_dir.name,
                                       "tags": list(logging.tags), "dir": str(self.out_dir),
                                       "id": self._wandb_run_id(), "resume": "allow"}})
        if self.is_main and self.config.logging.progress:
            self._progress = progress_bar(total=self.total_steps, initial=self.step,
                                          unit="step", desc=self.stage)
        self.throughput.reset()
        self.started = time.perf_counter()
        return restored

    def _wandb_run_id(self) -> str:
        """One W&B run per out_dir, continued across resumes."""
        file = self.out_dir / "wandb-run-id"
        if self.is_main and not file.is_file():
            file.write_text(uuid.uuid4().hex[:12])
        self.accelerator.wait_for_everyone()
        return file.read_text().strip()

    def autocast(self) -> contextlib.AbstractContextManager:
        """The launch's mixed precision for forwards outside the prepared model's own
        (references, teachers, rollouts): see `lathe.pretrain.runtime.precision`."""
        return self.accelerator.autocast()

    # -- one optimizer step --------------------------------------------------------------

    def train_step(self, micro_batches: Sequence[Any], loss_fn: LossFn,
                   work_of: Callable[[Any], Work]) -> StepResult:
        """One optimizer step over `grad_accum_steps` micro-batches of this rank.

        The step's gradient is that of the mean loss over every unit of every micro-batch
        on every rank, however the units fall into micro-batches: each micro-batch's mean
        is weighted by its share of the global unit count (one all-reduce before the first
        forward), the fix transformers 4.46 made for gradient accumulation. Metrics are
        weighted the same way, so their mean over ranks in `log_step` is the global mean.
        """
        if len(micro_batches) != self.config.grad_accum_steps:
            raise ValueError(f"train_step got {len(micro_batches)} micro-batches, expected "
                             f"grad_accum_steps={self.config.grad_accum_steps}")
        works = [work_of(batch) for batch in micro_batches]
        local = torch.tensor([[w.units, w.tokens, w.flops] for w in works],
                             dtype=torch.float64).sum(0)
        units, tokens, flops = self.accelerator.reduce(local.to(self.device),
                                                       reduction="sum").tolist()
        units = max(units, 1e-12)  # a step with nothing to learn from has zero gradient
        lr = self.config.optim.lr * lr_factor(self.step, self.planned_steps,
                                              self.config.schedule, self.cooldown)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        self.model.train()
        sums: dict[str, Tensor] = {}
        grad_norm = None
        for index, (batch, work) in enumerate(zip(micro_batches, works, strict=True)):
            share = work.units * self.world_size / units
            with self.accelerator.accumulate(self.model):
                loss, metrics = loss_fn(self.model, batch)
                # backward() divides by grad_accum_steps and the gradient all-reduce by the
                # world size; the share undoes both and weights this micro-batch's mean
                self.accelerator.backward(loss * (share * len(micro_batches)))
                if index == 0:
                    failpoint("step", self.step + 1, self.rank)
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0) + value.detach().float() * share
                if self.accelerator.sync_gradients:
                    grad_norm = self._clip_gradients()
                for optimizer in self.optimizers:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += int(tokens)
        self.throughput.add(int(tokens), flops)
        return StepResult(lr, grad_norm, sums)

    def _clip_gradients(self) -> float | None:
        max_norm = self.config.optim.grad_clip
        norm = self.accelerator.clip_grad_norm_(
            self.model.parameters(), max_norm if max_norm is not None else math.inf)
        if norm is None:
            return None
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # -- logging -------------------------------------------------------------------------

    def log_step(self, result: StepResult) -> dict[str, float] | None:
        """Average metrics over ranks and log them every `log_every` steps (collective)."""
        every = self.config.logging.log_every
        if self.step % every and self.step != self.total_steps:
            self._advance_progress(None)
            return None
        names = sorted(result.metrics)
        values = [torch.as_tensor(result.metrics[n], dtype=torch.float32, device=self.device)
                  for n in names]
        reduced = self.accelerator.reduce(torch.stack(values), reduction="mean")
        record = {name: float(value) for name, value in zip(names, reduced.tolist(), strict=True)}
        record.update(lr=result.lr, tokens_seen=self.tokens_seen,
                      **self.throughput.measure(), **memory_stats(self.device))
        if result.grad_norm is not None:
            record["grad_norm"] = result.grad_norm
        self.metrics.log(record, self.step)
        self._advance_progress(record)
        return record

    def _advance_progress(self, record: dict[str, float] | None) -> None:
        if self._progress is None:
            return
        if record is not None:
            shown = {"loss": f"{record.get('loss', float('nan')):.4f}",
                     "tok/s": f"{record['tokens_per_s']:,.0f}"}
            self._progress.set_postfix(shown, refresh=False)
        self._progress.update(1)

    def log(self, metrics: dict[str, Any]) -> None:
        self.metrics.log(metrics, self.step)

    def print(self, *args: Any) -> None:
        """Print once (rank 0), without breaking the progress bar."""
        if self.is_main:
            (self._progress.write if self._progress else print)(" ".join(map(str, args)))

    # -- state and export ----------------------------------------------------------------

    def begin_cooldown(self, steps: int) -> None:
        """Train `steps` more (no further than the planned end) with the learning rate
        falling linearly to the schedule's floor, then end: the run's last step moves there.
        Every rank calls it alike (on a metric reduced over ranks); a resume restores it."""
        self._set_cooldown(self.step, self.step + steps)

    def _set_cooldown(self, start: int, end: int) -> None:
        end = min(end, self.total_steps)  # a resume may plan fewer steps
        self.cooldown = (start, end)
        self.total_steps = end
        if self._progress is not None:
            self._progress.total = end
            self._progress.refresh()

    def save(self, extra: dict[str, Any]) -> Path:
        """Save the full training state at the current step (collective)."""
        return training_state.save_state(
            self.accelerator, self.out_dir, self.step,
            {"tokens_seen": self.tokens_seen, "world_size": self.world_size,
             "cooldown": self.cooldown, **extra},
            keep_last=self.config.checkpoint.keep_last)

    def should(self, every: int) -> bool:
        return self.step % every == 0 or self.step == self.total_steps

    def export(self, model_config: ModelConfig, path: Path, tokenizer: Path | None,
               provenance: dict[str, Any], lora: LoraSection | None = None,
               base: Path | None = None, chat_template: str | None = None) -> Path:
        """Write the HF-layout checkpoint from the full (gathered) weights (collective).

        With `lora`, the adapters are also saved as a peft folder beside it
        (`<path>-adapter`, naming the `base` checkpoint) and merged into the exported weights.
        `chat_template` replaces the template the tokenizer folder carries.
        """
        state = self.accelerator.get_state_dict(self.model)
        if self.is_main:
            dtype = torch.bfloat16 if self.accelerator.mixed_precision == "bf16" else None
            model = plain_model(model_config, state, dtype, lora)
            if lora is not None:
                if base is None:
                    raise ValueError("export with lora needs the base checkpoint it adapts")
                save_adapter(model, lora, path.with_name(path.name + "-adapter"), base)
                merge_lora(model)
            save_checkpoint(model, path, tokenizer=tokenizer, provenance={
                "stage": self.stage, "steps": self.step, "tokens_seen": self.tokens_seen,
                "parallel": self.setup, **provenance}, chat_template=chat_template)
        self.accelerator.wait_for_everyone()
        return path

    def finish(self) -> float:
        """Close the progress bar and trackers; return the run's wall-clock seconds."""
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        self.accelerator.end_training()
        return time.perf_counter() - self.started


def plain_model(config: ModelConfig, state: dict[str, Tensor],
                dtype: torch.dtype | None = None, lora: LoraSection | None = None) -> Transformer:
    """A single-device `Transformer` (with `lora`'s adapters) holding a gathered state dict,
    checked for completeness."""
    with torch.device("meta"):
        model = Transformer(config)
        if lora is not None:  # a gathered copy is full precision: QLoRA's 4-bit base is not
            apply_lora(model, dataclasses.replace(lora, qlora=False))
    expected = set(model.state_dict())
    missing = expected - set(state) - ({"lm_head.weight", "lm_head.base_layer.weight"}
                                       if config.tie_embeddings else set())
    unexpected = set(state) - expected
    if missing or unexpected:
        raise RuntimeError(f"gathered weights do not match the model: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")
    state = {k: v.detach().to("cpu", dtype or v.dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.reset_rotary("cpu")
    return model
