"""`lathe plan`: will a stage's run fit, before it loads a weight or waits on a GPU.

For a stage, its recipe (with dotted overrides) and an accelerate launch file, print each
rank's predicted peak by what holds it (`lathe.pretrain.runtime.memory_plan`), and with
`--memory` the largest micro-batch that fits that many GiB. It reads the model's config
only — `config.json` of a post-training checkpoint, or pretraining's preset and tokenizer —
so an 8B plan takes seconds on a laptop. Each stage says what its micro-batch is
(`step_shape`); the same plan opens every stage's log.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lathe.core.config import load_config
from lathe.core.errors import ConfigError
from lathe.data.tokenizer import load_tokenizer
from lathe.model.checkpoint import read_model_config
from lathe.model.config import ModelConfig
from lathe.posttrain import distill, dpo, grpo, reward_model, sft
from lathe.posttrain.config import DistillConfig, DPOConfig, GRPOConfig, RMConfig, SFTConfig
from lathe.pretrain import train
from lathe.pretrain.config import PretrainConfig
from lathe.pretrain.runtime.memory_plan import (
    GIB,
    MemoryPlan,
    Parallelism,
    gib,
    largest_micro_batch,
    parallelism_from_launch_file,
    plan_memory,
)


@dataclass(frozen=True)
class Stage:
    config: type
    shape: Callable[..., Any]  # (config, parallelism, model config) -> StepShape
    model: Callable[[Any], ModelConfig]


def _pretrain_model(config: PretrainConfig) -> ModelConfig:
    if "vocab_size" in config.model.overrides:
        return config.model.build(int(config.model.overrides["vocab_size"]))
    if not Path(config.data.tokenizer).exists():
        raise ConfigError(f"data.tokenizer={config.data.tokenizer!r} does not exist yet, and the "
                          "vocabulary size follows it; pass --model.overrides.vocab_size=N")
    return config.model.build(load_tokenizer(config.data.tokenizer)
                              .get_vocab_size(with_added_tokens=True))


def _checkpoint_model(config: Any) -> ModelConfig:
    return read_model_config(config.model)


def _classifier_model(config: Any) -> ModelConfig:
    """A reward model of the starting checkpoint: its decoder under a one-label score head."""
    return dataclasses.replace(read_model_config(config.model), num_labels=1)


STAGES: dict[str, Stage] = {
    "pretrain": Stage(PretrainConfig, lambda config, parallelism, model:
                      train.step_shape(config), _pretrain_model),
    "sft": Stage(SFTConfig, sft.step_shape, _checkpoint_model),
    "dpo": Stage(DPOConfig, dpo.step_shape, _checkpoint_model),
    "grpo": Stage(GRPOConfig, grpo.step_shape, _checkpoint_model),
    "distill": Stage(DistillConfig, distill.step_shape, _checkpoint_model),
    "rm": Stage(RMConfig, reward_model.step_shape, _classifier_model),
}


def plan_stage(stage: str, config: Any, parallelism: Parallelism) -> MemoryPlan:
    """The memory plan of one step of `stage` run with `config` on `parallelism`."""
    spec = STAGES[stage]
    model = spec.model(config)
    precision = config.precision
    return plan_memory(model, spec.shape(config, parallelism, model), parallelism,
                       lora=getattr(config, "lora", None),
                       activation_checkpointing=precision.activation_checkpointing,
                       z_loss=precision.z_loss)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lathe plan",
        description="Predict each rank's peak memory for a stage's recipe and launch, and the "
                    "largest micro-batch that fits. Override any recipe field with "
                    "--dotted.key=value.")
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--config", type=Path, help="the stage's YAML recipe")
    parser.add_argument("--launch", type=Path,
                        help="accelerate config file, e.g. recipes/accelerate/8gpu-zero3.yaml "
                             "(default: one process)")
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        help="default: the launch file's (cpu for recipes/accelerate/cpu*), "
                             "else cuda")
    parser.add_argument("--memory", type=float, metavar="GIB",
                        help="memory of one device in GiB: also find the largest micro-batch "
                             "that fits it")
    args, rest = parser.parse_known_args(argv)
    config = load_config(STAGES[args.stage].config, args.config, rest)
    if args.launch is not None:
        parallelism = parallelism_from_launch_file(args.launch, args.device)
    else:
        device = args.device or "cuda"
        parallelism = Parallelism(mixed_precision="bf16" if device == "cuda" else "no",
                                  device=device)
    if config.precision.mixed_precision is not None:  # the recipe's wins, as at run time
        parallelism = dataclasses.replace(parallelism,
                                          mixed_precision=config.precision.mixed_precision)
    plan = plan_stage(args.stage, config, parallelism)
    print(plan.table())
    if args.memory is not None:
        if args.memory <= 0:
            raise ConfigError(f"--memory={args.memory} must be a positive number of GiB")
        fits_in = int(args.memory * GIB)
        if args.stage == "grpo":  # its micro-batch follows from the rollouts per step
            verdict = "fits" if plan.total <= fits_in else "does not fit"
            print(f"{verdict} {args.memory:g} GiB; GRPO's micro-batch is prompts_per_step × "
                  "num_generations ÷ processes ÷ grad_accum_steps: raise grad_accum_steps "
                  "to shrink it")
            return 0

        def plan_for(micro_batch: int) -> MemoryPlan:
            return plan_stage(args.stage, dataclasses.replace(
                config, micro_batch_size=micro_batch), parallelism)

        best = largest_micro_batch(fits_in, plan_for)
        if best == 0:
            print(f"no micro-batch fits {args.memory:g} GiB: even 1 needs "
                  f"{gib(plan_for(1).total)}; shard more (ZeRO-3, FSDP2), use LoRA, "
                  "checkpoint activations or shorten sequences")
        else:
            print(f"largest micro-batch that fits {args.memory:g} GiB: {best} "
                  f"(peak {gib(plan_for(best).total)})")
    return 0
