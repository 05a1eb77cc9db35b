"""`lathe report` on a real (short) run: the stage table from its own metrics, the plots
as PNG files, samples, and runs that are half-written or not runs at all."""

from __future__ import annotations

import json
import shutil

import pytest

from lathe.core.cli import main
from lathe.core.errors import ConfigError
from lathe.pretrain.runtime.report import build_report
from tests.posttrain.conftest import quick

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    assert main(["sft", *quick(root / "sft", base, max_steps=4, **{"eval.every": 2,
                                                                      "data.limit": 64})]) == 0
    with (root / "sft" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 1.')  # a run killed mid-write leaves half a line
    return root


def test_report_tables_each_stage_from_its_own_records(run, capsys):
    assert main(["report", str(run)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((run / "sft" / "summary.json").read_text())
    start, end = summary["accuracy"][0], summary["accuracy"][-1]
    report = (run / "report.md").read_text()
    task = summary["task"]  # the stage's evaluation task names its accuracy row
    assert f"| sft | held-out {task} accuracy | {start:.1%} | {end:.1%} |" in report
    loss = summary["heldout_loss"]
    assert f"| sft | held-out assistant loss | {loss[0]:.4f} | {loss[-1]:.4f} |" in report
    assert f"sft held-out {task} accuracy" in printed and "report.md" in printed
    assert "Not in this run: pretrain, dpo, grpo, distill, sft-tools, grpo-tools." in report
    assert "Unreadable metrics lines skipped: sft 1." in report
    assert "- torch: " in report and "- lathe commit: " in report
    assert summary["seed"] == 0 and "- seed: 0 (every stage)" in report
    assert "seed: 0 (every stage)" in printed
    for name in ("learning-rate.png", "tokens-per-second.png", "accuracy.png"):
        assert f"(report/{name})" in report
        assert (run / "report" / name).read_bytes()[:8] == PNG
    assert not (run / "report" / "grpo.png").exists()  # no GRPO data, no empty plot
    assert "### sft" in report and "first evaluation" in report


def test_report_names_each_stage_seed_when_they_differ(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "dpo").mkdir()
    (copy / "dpo" / "summary.json").write_text(json.dumps({"seed": 2, "accuracy": [0.5]}))
    build_report(copy)
    assert "- seeds: sft 0, dpo 2" in (copy / "report.md").read_text()


@pytest.mark.parametrize(("grpo_task", "shown"), [("arithmetic3x3", True),
                                                    ("arithmetic3", False)])
def test_the_tool_model_is_set_beside_grpo_only_on_the_same_problems(run, tmp_path, grpo_task,
                                                                     shown):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for stage, task, accuracy in (("grpo", grpo_task, 0.55), ("grpo-tools", "arithmetic3x3_tool",
                                                               0.99)):
        (copy / stage).mkdir()
        (copy / stage / "summary.json").write_text(json.dumps({"seed": 0, "task": task}))
        (copy / stage / "metrics.jsonl").write_text(
            json.dumps({"step": 0, "eval/accuracy": accuracy - 0.1}) + "\n"
            + json.dumps({"step": 20, "eval/accuracy": accuracy}) + "\n")
    build_report(copy)
    row = ("| grpo-tools | held-out accuracy: grpo without a tool / with the calculator | 55.0% "
           "| 99.0% |")
    assert (row in (copy / "report.md").read_text()) is shown


def test_report_refuses_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(ConfigError, match="holds none of pretrain, sft"):
        build_report(tmp_path)
    with pytest.raises(ConfigError, match="is not a folder"):
        build_report(tmp_path / "missing")


@pytest.mark.slow
def test_report_puts_lathe_eval_results_beside_the_stages(run, base, tmp_path, capsys):
    """`lathe eval CKPT --output RUN/<stage>/eval.json` for the base and the SFT model: the
    report's benchmark table holds each task's metric for both, as lm-eval scored them."""
    pytest.importorskip("lm_eval")
    from tests.serve.test_lm_eval import write_task
    task = write_task(tmp_path)
    run = shutil.copytree(run, tmp_path / "run")
    (run / "pretrain").mkdir()
    for stage, checkpoint in (("pretrain", base), ("sft", run / "sft" / "final")):
        assert main(["eval", str(checkpoint), "--tasks", task, "--include-path", str(tmp_path),
                     "--output", str(run / stage / "eval.json")]) == 0
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    printed, report = capsys.readouterr().out, (run / "report.md").read_text()
    scores = [json.loads((run / stage / "eval.json").read_text())["results"][task]
              for stage in ("pretrain", "sft")]
    shown = [f"{s['acc,none']:.4f} ± {s['acc_stderr,none']:.4f}" for s in scores]
    assert "| task | metric | pretrain | sft |" in report
    assert f"| {task} | acc | {shown[0]} | {shown[1]} |" in report
    assert f"{task} acc: pretrain {shown[0]}, sft {shown[1]}" in printed
    assert "Not in this run: dpo, grpo" in report  # a stage with only eval.json is in it
