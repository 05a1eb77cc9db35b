"""The typed config of the training runtime, shared by every training stage.

`TrainConfig` holds what any stage trained on the runtime needs — optimizer, LR schedule,
run length, precision and the "applied from outside" model transforms, checkpointing,
evaluation cadence and logging. Pretraining (`lathe.pretrain.config.PretrainConfig`) adds
the model and the token shards, each post-training stage its checkpoint and data.
Defaults are the tiny CPU run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lathe.core.errors import ConfigError


@dataclass
class OptimConfig:
    """AdamW on every parameter, or Muon on the hidden matrices and AdamW on the rest.

    Weight decay applies to matrices only (never to norms or biases). Muon uses torch's
    `match_rms_adamw` scaling, so one `lr` serves both optimizers.
    """

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    muon_momentum: float = 0.95
    grad_clip: float | None = 1.0  # max global L2 norm; null disables clipping


@dataclass
class ScheduleConfig:
    """Linear warmup, then cosine decay to `min_lr_ratio`·lr, or warmup-stable-decay (WSD):
    constant after warmup, then a linear decay over the last `decay_fraction` of the run."""

    kind: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2


@dataclass
class PrecisionConfig:
    """Numerics applied to the model from outside it.

    `mixed_precision` null takes the accelerate launch config's value, or bf16 on CUDA and
    fp32 ("no") on CPU when launched without one. `fp8` converts eligible linears with
    torchao (emulated off-GPU, so the same code path is tested on CPU).
    """

    mixed_precision: Literal["no", "bf16", "fp16"] | None = None
    fp8: bool = False
    activation_checkpointing: bool = False
    compile: bool = False
    z_loss: float = 0.0  # coefficient of mean(logsumexp(logits)^2); 0 disables it


@dataclass
class CheckpointConfig:
    """Training-state folders under `<out_dir>/state/` every `every` steps and at the end."""

    every: int = 100
    keep_last: int = 2


@dataclass
class EvalConfig:
    """Validation loss and bits per byte on `batches` fixed val batches, plus samples."""

    every: int = 100
    batches: int = 8
    # no trailing space: a BPE whose words carry their leading space rarely sees a lone " "
    sample_prompts: list[str] = field(default_factory=lambda: ["def", "The"])
    sample_tokens: int = 32
    # samples are drawn as nanoGPT's are (greedy decoding of a small model loops on one
    # token long before its text stops looking like the corpus); 0 means greedy
    sample_temperature: float = 0.8
    sample_top_k: int = 50


@dataclass
class LoggingConfig:
    """W&B through accelerate's tracker (offline when no API key) and metrics.jsonl."""

    report_to: Literal["wandb", "none"] = "wandb"
    project: str = "lathe"
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)
    log_every: int = 1
    progress: bool = True


@dataclass
class TrainConfig:
    """Everything the runtime owns. Exactly one of max_steps, max_tokens and
    tokens_per_param sets the run length (tokens_per_param × parameters, e.g. 20 for
    Chinchilla-optimal)."""

    out_dir: str = "runs/pretrain"
    seed: int = 0
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    max_steps: int | None = 100
    max_tokens: int | None = None
    tokens_per_param: float | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        lengths = [name for name in ("max_steps", "max_tokens", "tokens_per_param")
                   if getattr(self, name) is not None]
        if len(lengths) != 1:
            raise ConfigError(
                f"run length: set exactly one of max_steps, max_tokens, tokens_per_param "
                f"(got {', '.join(lengths) or 'none'}); e.g. --max_steps=null --max_tokens=1e6")
        for name in ("micro_batch_size", "grad_accum_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        for name, value in (("checkpoint.every", self.checkpoint.every),
                            ("checkpoint.keep_last", self.checkpoint.keep_last),
                            ("eval.every", self.eval.every),
                            ("logging.log_every", self.logging.log_every)):
            if value < 1:
                raise ConfigError(f"{name}={value} must be at least 1")
        if self.schedule.warmup_steps < 0:
            raise ConfigError(f"schedule.warmup_steps={self.schedule.warmup_steps} must be >= 0")
        if not 0 <= self.schedule.min_lr_ratio <= 1:
            raise ConfigError(
                f"schedule.min_lr_ratio={self.schedule.min_lr_ratio} must be in [0, 1]")
        if not 0 < self.schedule.decay_fraction <= 1:
            raise ConfigError(
                f"schedule.decay_fraction={self.schedule.decay_fraction} must be in (0, 1]")
        if self.optim.lr <= 0:
            raise ConfigError(f"optim.lr={self.optim.lr} must be positive")
        if not 0 <= self.eval.sample_temperature <= 2 or self.eval.sample_top_k < 0:
            raise ConfigError(f"eval.sample_temperature={self.eval.sample_temperature} must be "
                              f"in [0, 2] (0: greedy) and eval.sample_top_k="
                              f"{self.eval.sample_top_k} >= 0 (0: no cut)")

    def total_steps(self, tokens_per_step: int, num_params: int) -> int:
        """The run length in optimizer steps, whichever way it was given."""
        if self.max_steps is not None:
            steps = self.max_steps
        else:
            tokens = (self.max_tokens if self.max_tokens is not None
                      else self.tokens_per_param * num_params)
            steps = -(-int(tokens) // tokens_per_step)
        if steps < 1:
            raise ConfigError(f"the run length comes to {steps} steps; it must be at least 1")
        return steps
