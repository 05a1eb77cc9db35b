"""`lathe report RUN_DIR`: a run's report card, `RUN_DIR/report.md` with PNG plots in
`RUN_DIR/report/`, built only from what each stage wrote (`metrics.jsonl`, `summary.json`
in `RUN_DIR/<stage>/`), so any finished or half-finished run can have one; a stage's
checkpoint scored with `lathe eval CKPT --output RUN_DIR/<stage>/eval.json` adds its
lm-eval results, each task's metrics side by side across the stages.

At the top: the environment (lathe commit, torch, device). Then the table a person reads
first — each stage's own metric at its start and end (pretraining val bits-per-byte,
held-out task accuracy after SFT, DPO and GRPO, DPO's held-out preference accuracy, GRPO's
mean reward, the distilled student against its teacher, and the tool stage's accuracy with
the calculator beside GRPO's without it) — then the curves: losses and val bpb, learning
rate, tokens/s, task accuracy, GRPO reward and accuracy, the tool stage's reward and calls,
DPO margins, and samples from the first and last evaluation of each stage.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lathe.core.atomic import atomic_file
from lathe.core.errors import ConfigError

# the README run's stages; sft-tools and grpo-tools are its tool stage (SFT on calculator
# chats, then GRPO with multi-turn tool rollouts), measured against grpo without the tool
STAGES = ("pretrain", "sft", "dpo", "grpo", "distill", "sft-tools", "grpo-tools")
Curve = tuple[str, list[int], list[float]]  # label, steps, values
EVAL_FILE = "eval.json"  # lm-eval's results, as `lathe eval --output` writes them


@dataclass
class Stage:
    name: str
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    skipped_lines: int = 0
    benchmarks: dict[str, Any] | None = None  # lm-eval's "results", by task

    def curve(self, key: str, label: str | None = None) -> Curve:
        points = [(r["step"], r[key]) for r in self.records
                  if isinstance(r.get(key), (int, float)) and isinstance(r.get("step"), int)]
        return (label or f"{self.name} {key}", [s for s, _ in points], [v for _, v in points])

    def values(self, key: str) -> list[float]:
        return self.curve(key)[2]

    def texts(self, key: str) -> list[list]:
        return [r[key] for r in self.records if isinstance(r.get(key), list)]


def read_stage(folder: Path) -> Stage | None:
    """A stage's records and summary; None when it never ran. A line that is not a JSON
    object (a run killed mid-write) is skipped and counted."""
    metrics, summary = folder / "metrics.jsonl", folder / "summary.json"
    benchmarks = _read_object(folder / EVAL_FILE).get("results")
    if not metrics.is_file() and not summary.is_file() and benchmarks is None:
        return None
    records, skipped = [], 0
    if metrics.is_file():
        for line in metrics.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict):
                records.append(record)
            elif line.strip():
                skipped += 1
    return Stage(folder.name, records, _read_object(summary), skipped,
                 benchmarks if isinstance(benchmarks, dict) else None)


def _read_object(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} when it is missing, unreadable or not an object."""
    try:
        loaded = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        loaded = {}
    return loaded if isinstance(loaded, dict) else {}


def benchmark_table(stages: dict[str, Stage]) -> tuple[list[str], list[list[str]]]:
    """The stages with lm-eval results, and one row per (task, metric) — the metric named
    with its filter when that is not lm-eval's "none" — with each stage's value ± its
    standard error, "–" where a stage did not score it."""
    scored = [name for name, s in stages.items() if s.benchmarks]
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for name in scored:
        for task, metrics in stages[name].benchmarks.items():
            if not isinstance(metrics, dict):
                continue
            for key, value in metrics.items():
                metric, _, kind = key.partition(",")
                if not kind or metric.endswith("_stderr") or isinstance(value, bool) \
                        or not isinstance(value, (int, float)):
                    continue
                stderr = metrics.get(f"{metric}_stderr,{kind}")
                shown = f"{value:.4f}" + (f" ± {stderr:.4f}" if isinstance(
                    stderr, (int, float)) and not isinstance(stderr, bool) else "")
                label = metric if kind == "none" else f"{metric} ({kind})"
                cells.setdefault((task, label), {})[name] = shown
    rows = [[task, metric, *(by_stage.get(name, "–") for name in scored)]
            for (task, metric), by_stage in sorted(cells.items())]
    return scored, rows


def environment() -> dict[str, str]:
    source = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)")
    return {"lathe commit": commit or "unknown (not a git checkout)",
            "torch": torch.__version__, "device": device, "python": platform.python_version(),
            "report written": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%d %H:%M UTC")}


def seed_line(stages: dict[str, Stage]) -> str | None:
    """The seed each training stage ran with, as its summary.json says: one figure when they
    share it. The README run's figures are one draw of each seed (docs/readme-run-quality.md)."""
    seeds = {name: seed for name, stage in stages.items()
             if isinstance(seed := stage.summary.get("seed"), int) and not isinstance(seed, bool)}
    if not seeds:
        return None
    if len(set(seeds.values())) == 1:
        return f"seed: {next(iter(seeds.values()))} (every stage)"
    return "seeds: " + ", ".join(f"{name} {seed}" for name, seed in seeds.items())


def _first_last(values: list[float]) -> tuple[float, float] | None:
    return (values[0], values[-1]) if values else None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def stage_table(stages: dict[str, Stage]) -> list[tuple[str, str, str, str]]:
    """(stage, metric, start, end) rows, for the stages that ran."""
    rows: list[tuple[str, str, str, str]] = []

    def add(stage: str, metric: str, pair: tuple[float, float] | None, percent: bool) -> None:
        if pair is not None:
            shown = [f"{v:.1%}" if percent else f"{v:.4f}" for v in pair]
            rows.append((stage, metric, shown[0], shown[1]))

    if (s := stages.get("pretrain")) is not None:
        add("pretrain", "val bits per byte", _first_last(s.values("val/bpb")), False)
        add("pretrain", "val loss", _first_last(s.values("val/loss")), False)
    def accuracy(s: Stage) -> str:
        task = s.summary.get("task")
        return f"held-out {task} accuracy" if isinstance(task, str) else "held-out accuracy"

    if (s := stages.get("sft")) is not None:
        add("sft", accuracy(s), _first_last(s.values("eval/accuracy")), True)
        add("sft", "held-out assistant loss", _first_last(s.values("eval/heldout_loss")), False)
    if (s := stages.get("dpo")) is not None:
        add("dpo", accuracy(s), _first_last(s.values("eval/accuracy")), True)
        add("dpo", "held-out preference accuracy",
            _first_last(s.values("eval/preference_accuracy")), True)
    if (s := stages.get("grpo")) is not None:
        add("grpo", accuracy(s), _first_last(s.values("eval/accuracy")), True)
        rewards = s.values("reward/mean")
        if rewards:
            add("grpo", "mean reward (first / last 5 batches)",
                (_mean(rewards[:5]), _mean(rewards[-5:])), False)
    if (s := stages.get("distill")) is not None:
        student, teacher = s.summary.get("student_accuracy"), s.summary.get("teacher_accuracy")
        if isinstance(student, (int, float)) and isinstance(teacher, (int, float)):
            rows.append(("distill", f"student / teacher {accuracy(s)}", f"{student:.1%}",
                         f"{teacher:.1%}"))
        add("distill", "held-out KL to teacher", _first_last(s.values("eval/kl_to_teacher")),
            False)
        add("distill", "held-out KL(student ‖ teacher) on its own samples",
            _first_last(s.values("eval/reverse_kl")), False)
    if (s := stages.get("sft-tools")) is not None:
        add("sft-tools", accuracy(s), _first_last(s.values("eval/accuracy")), True)
    if (s := stages.get("grpo-tools")) is not None:
        add("grpo-tools", accuracy(s), _first_last(s.values("eval/accuracy")), True)
        without = stages.get("grpo")
        # side by side only on the same problems: a tool task is its no-tool task's "_tool"
        same = without is not None and f"{without.summary.get('task')}_tool" == s.summary.get(
            "task")
        if same and without.values("eval/accuracy") and s.values("eval/accuracy"):
            add("grpo-tools", "held-out accuracy: grpo without a tool / with the calculator",
                (without.values("eval/accuracy")[-1], s.values("eval/accuracy")[-1]), True)
        for key, what in (("tools/calls_per_episode", "tool calls per episode"),
                          ("tools/errors_per_episode", "tool errors per episode")):
            values = s.values(key)
            if values:
                add("grpo-tools", f"{what} (first / last 5 batches)",
                    (_mean(values[:5]), _mean(values[-5:])), False)
    return rows


def plot(path: Path, title: str, curves: list[Curve], ylabel: str,
         log_y: bool = False) -> bool:
    """One PNG of `curves` against their steps; False (and no file) when all are empty."""
    curves = [c for c in curves if c[1]]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or assumed
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for label, steps, values in curves:
        axes.plot(steps, values, label=label, marker="o" if len(steps) < 20 else None)
    axes.set(title=title, xlabel="step", ylabel=ylabel)
    if log_y:
        axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    with atomic_file(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)
    plt.close(figure)
    return True


def plots(stages: dict[str, Stage], folder: Path) -> list[tuple[str, str]]:
    """Every plot this run has data for: (file name, caption)."""
    def of(name: str, key: str, label: str | None = None) -> Curve:
        stage = stages.get(name)
        return stage.curve(key, label) if stage is not None else ("", [], [])

    present = [name for name in STAGES if name in stages]

    def task_label(name: str) -> str:
        task = stages[name].summary.get("task")
        return f"{name} ({task})" if isinstance(task, str) else name

    specs = [
        ("pretrain-loss.png", "Pretraining loss", [of("pretrain", "loss", "train loss"),
                                                  of("pretrain", "val/loss", "val loss")],
         "cross-entropy (nats)", False),
        ("pretrain-bpb.png", "Pretraining val bits per byte",
         [of("pretrain", "val/bpb", "val bpb")], "bits per byte", False),
        ("learning-rate.png", "Learning rate", [of(n, "lr", n) for n in present], "lr", False),
        ("tokens-per-second.png", "Training tokens/s",
         [of(n, "tokens_per_s", n) for n in present], "tokens/s", True),
        ("accuracy.png", "Held-out task accuracy (greedy)",
         [of(n, "eval/accuracy", task_label(n)) for n in present], "accuracy", False),
        ("grpo.png", "GRPO rollouts", [of("grpo", "reward/mean", "mean reward"),
                                       of("grpo", "train/accuracy", "rollout accuracy"),
                                       of("grpo", "eval/accuracy", "held-out accuracy")],
         "reward / accuracy", False),
        ("tools.png", "GRPO with the calculator: multi-turn tool rollouts",
         [of("grpo-tools", "reward/mean", "mean reward"),
          of("grpo-tools", "eval/accuracy", "held-out accuracy"),
          of("grpo-tools", "tools/calls_per_episode", "tool calls per episode"),
          of("grpo-tools", "tools/errors_per_episode", "tool errors per episode")],
         "reward / accuracy / count", False),
        ("dpo.png", "DPO", [of("dpo", "rewards/margins", "reward margin"),
                            of("dpo", "eval/preference_accuracy", "held-out preference acc.")],
         "margin / accuracy", False),
    ]
    made = []
    for name, title, curves, ylabel, log_y in specs:
        if plot(folder / name, title, curves, ylabel, log_y):
            made.append((name, title))
    return made


def samples_section(stages: dict[str, Stage]) -> list[str]:
    lines = []
    for name, key in (("pretrain", "samples"), ("sft", "eval/samples"), ("dpo", "eval/samples"),
                      ("grpo", "eval/samples"), ("sft-tools", "eval/samples"),
                      ("grpo-tools", "eval/samples")):
        stage = stages.get(name)
        texts = stage.texts(key) if stage is not None else []
        if not texts:
            continue
        lines.append(f"### {name}\n")
        for when, rows in (("first evaluation", texts[0]), ("last evaluation", texts[-1])):
            lines.append(f"{when}:\n")
            for row in rows[:3]:
                prompt, completion = (row + ["", ""])[:2] if isinstance(row, list) else (row, "")
                lines.append(f"- `{prompt!r}` → `{completion!r}`")
            lines.append("")
    return lines


def build_stages(run_dir: Path) -> dict[str, Stage]:
    """The README run's stages found in `run_dir`, in order."""
    return {name: stage for name in STAGES if (stage := read_stage(run_dir / name)) is not None}


def build_report(run_dir: str | Path) -> tuple[Path, list[tuple[str, str, str, str]]]:
    """Write RUN_DIR/report.md and its plots; returns the report's path and its table."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR {str(run_dir)!r} is not a folder; pass the folder a run "
                          "wrote its stages into, e.g. runs/e2e")
    stages = build_stages(run_dir)
    if not stages:
        raise ConfigError(f"{run_dir} holds none of {', '.join(STAGES)} (each a folder with "
                          "metrics.jsonl or summary.json); is this a lathe run folder?")
    folder = run_dir / "report"
    folder.mkdir(exist_ok=True)
    table = stage_table(stages)
    lines = [f"# Report: {run_dir.resolve().name}", ""]
    lines += [f"- {key}: {value}" for key, value in environment().items()]
    if (seeds := seed_line(stages)) is not None:
        lines.append(f"- {seeds}")
    lines += ["", "## Each stage's own metric", "", "| stage | metric | start | end |",
              "|---|---|---:|---:|"]
    lines += [f"| {' | '.join(row)} |" for row in table]
    scored, benchmarks = benchmark_table(stages)
    if benchmarks:
        lines += ["", "## Benchmarks (`lathe eval`, lm-eval tasks)", "",
                  f"| task | metric | {' | '.join(scored)} |",
                  f"|---|---|{'---:|' * len(scored)}"]
        lines += [f"| {' | '.join(row)} |" for row in benchmarks]
    missing = [name for name in STAGES if name not in stages]
    skipped = {name: s.skipped_lines for name, s in stages.items() if s.skipped_lines}
    if missing:
        lines += ["", f"Not in this run: {', '.join(missing)}."]
    if skipped:
        lines += ["", "Unreadable metrics lines skipped: "
                  + ", ".join(f"{name} {n}" for name, n in skipped.items()) + "."]
    lines += ["", "## Curves", ""]
    lines += [f"![{title}](report/{name})\n" for name, title in plots(stages, folder)]
    samples = samples_section(stages)
    if samples:
        lines += ["## Samples", "", *samples]
    path = run_dir / "report.md"
    with atomic_file(path) as tmp:
        tmp.write_text("\n".join(lines).rstrip() + "\n")
    return path, table


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lathe report",
        description="Write RUN_DIR/report.md with plots from the stages' metrics.jsonl and "
                    "summary.json files, and print its table.")
    parser.add_argument("run_dir", type=Path, help="the run folder, e.g. runs/e2e")
    args = parser.parse_args(argv)
    path, table = build_report(args.run_dir)
    stages = build_stages(args.run_dir)
    if (seeds := seed_line(stages)) is not None:
        print(f"  {seeds}")
    width = max((len(f"{stage} {metric}") for stage, metric, _, _ in table), default=0)
    for stage, metric, start, end in table:
        print(f"  {f'{stage} {metric}':<{width}}  {start:>8} -> {end}")
    scored, benchmarks = benchmark_table(stages)
    for task, metric, *values in benchmarks:
        print(f"  {task} {metric}: " + ", ".join(
            f"{name} {value}" for name, value in zip(scored, values, strict=True)))
    print(f"report: {path}")
    return 0
