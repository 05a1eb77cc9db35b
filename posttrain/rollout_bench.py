"""`python -m lathe.posttrain.rollout_bench`: where GRPO's rollouts are sampled, and what a
step costs for it — the README run's GRPO stage (recipes/grpo/e2e.yaml, plain sampling:
one generation round a step every way) from the same checkpoint, for the same steps and
seed, five ways, each a `lathe grpo` run of its own, one after the other:

- the in-process engine, one process (the default), and the same on one thread (a rank's
  share of this machine's cores under two processes: the baseline for two ranks; off
  CUDA only);
- each rank's own engine, two processes (recipes/accelerate/cpu-ddp.yaml; off CUDA only);
- a server of the run's own (`rollout.url=local`), synchronous: sample, train, push;
- the same server, asynchronous (`rollout.max_staleness=1`): the next step sampled while
  this one trains, corrected by truncated importance sampling.

Every run corrects the sampling gap the same way (`sampling_correction=token_truncate`), so
only where the rollouts come from differs. Per run: the stage's seconds (start-up, the two
held-out evaluations and the steps), the seconds a step waited for its rollouts (median:
the step's completion tokens over `rollout/tokens_per_s`, the slowest rank's), the training
tokens/s (median), the mean reward of the first and last five batches and the held-out
accuracy before and after. Give `--checkpoint` a trained model (the README run's
runs/e2e/dpo/final) for rewards and accuracies that mean something; without one, a random
model of the README's shape times the same work.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from lathe.core.bench_history import add_history_arguments, history_folder, record
from lathe.posttrain.bench import device_name, readme_checkpoint
from lathe.posttrain.plan_bench import run_stage

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@dataclass(frozen=True)
class RolloutCase:
    label: str
    flags: tuple[str, ...] = ()
    launch: str | None = None  # a recipes/accelerate file's stem; None: one process
    one_thread: bool = False  # OMP_NUM_THREADS=1


CASES = [
    RolloutCase("in-process engine, one process"),
    RolloutCase("in-process engine, one process on one thread", one_thread=True),
    RolloutCase("each rank's engine, DDP × 2", launch="cpu-ddp"),
    RolloutCase("server (rollout.url=local), synchronous", ("--rollout.url=local",)),
    RolloutCase("server, asynchronous (max_staleness 1)",
                ("--rollout.url=local", "--rollout.max_staleness=1")),
]


def run_case(case: RolloutCase, checkpoint: Path, steps: int, seed: int,
             out_dir: Path) -> dict[str, float]:
    """One `lathe grpo` run of `case`, to the end; its figures."""
    stage = ["-m", "lathe.posttrain.grpo", "--config", str(RECIPES / "grpo" / "e2e.yaml"),
             "--model", str(checkpoint), "--out_dir", str(out_dir), f"--seed={seed}",
             f"--max_steps={steps}", f"--eval.every={steps}", f"--checkpoint.every={steps}",
             "--dynamic_sampling=false", "--sampling_correction=token_truncate",
             "--logging.report_to=none", *case.flags]
    run_stage(case.label, stage, case.launch, 3600,
              **({"OMP_NUM_THREADS": "1"} if case.one_thread else {}))
    summary = json.loads((out_dir / "summary.json").read_text())
    recipe = yaml.safe_load((RECIPES / "grpo" / "e2e.yaml").read_text())
    rollouts = recipe["prompts_per_step"] * recipe["num_generations"]
    steps_logged = [r for r in map(json.loads, (out_dir / "metrics.jsonl").open())
                    if "rollout/tokens_per_s" in r]
    waits = [r["completion/mean_length"] * rollouts / r["rollout/tokens_per_s"]
             for r in steps_logged]
    rewards, accuracy = summary["reward"], summary["heldout_accuracy"]
    return {"seconds": summary["seconds"], "wait": statistics.median(waits),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps_logged),
            "reward_first": statistics.mean(rewards[:5]),
            "reward_last": statistics.mean(rewards[-5:]),
            "accuracy_first": accuracy[0], "accuracy_last": accuracy[-1]}


def rollout_table(checkpoint: Path | None, steps: int, seed: int, out: Path | None) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # two CPU processes, and one process on one thread, are this machine's cores' baselines
    cases = [c for c in CASES if device.type != "cuda" or (c.launch is None and not c.one_thread)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = checkpoint or readme_checkpoint(Path(tmp) / "random")
        for i, case in enumerate(cases):
            r = run_case(case, model, steps, seed, Path(tmp) / f"case-{i}")
            rows.append(f"| {case.label} | {r['seconds']:.0f} | {r['wait']:.3f} | "
                        f"{r['tokens_per_s']:,.0f} | {r['reward_first']:.3f} → "
                        f"{r['reward_last']:.3f} | {r['accuracy_first']:.2%} → "
                        f"{r['accuracy_last']:.2%} |")
            print(rows[-1], flush=True)
    command = "python -m lathe.posttrain.rollout_bench" + (
        f" --checkpoint {checkpoint}" if checkpoint else "") + f" --steps {steps} --seed {seed}"
    table = "\n".join([
        f"## GRPO rollouts: in process, on every rank, on a server, asynchronous — "
        f"{datetime.date.today()} — {device_name(device)}, torch {torch.__version__}",
        "",
        f"Command: `{command}`",
        "",
        f"recipes/grpo/e2e.yaml with plain sampling, {steps} steps, seed {seed}, from "
        + (f"`{checkpoint}`" if checkpoint else "a random model of the README's shape")
        + ". Waiting: the seconds a step waited for its rollouts (median); tokens/s: the "
        "training steps' (median).",
        "",
        "| rollouts | stage seconds | waiting, s/step | train tokens/s | mean reward, first → "
        "last 5 | held-out accuracy |",
        "|---|---:|---:|---:|---|---|",
        *rows, ""])
    record(table, out)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lathe.posttrain.rollout_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="the model GRPO starts from (default: a random README-shaped one)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    add_history_arguments(parser)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")
    if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
        parser.error(f"--checkpoint={args.checkpoint}: no config.json there; give a lathe or "
                     "Hugging Face checkpoint folder (e.g. runs/e2e/dpo/final)")
    print(rollout_table(args.checkpoint, args.steps, args.seed, history_folder(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
