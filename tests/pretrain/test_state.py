"""Training-state folders: which one `--resume auto` picks, why it skips the others, what a
killed save leaves and how it is cleared; failpoint specs; a torn metrics line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lathe.core import failpoints
from lathe.core.errors import ConfigError
from lathe.pretrain.runtime.monitor import MetricsLog
from lathe.pretrain.runtime.state import (
    TRAINER_STATE_FILE,
    remove_leftovers,
    resolve_resume,
    step_dir,
)
from lathe.pretrain.train import pretrain
from tests.pretrain.conftest import build, run_config, step_losses


def fake_state(out: Path, step: int, parts: dict[str, bytes]) -> Path:
    path = step_dir(out, step)
    path.mkdir(parents=True)
    for name, data in parts.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    files = {name: len(data) for name, data in parts.items()}
    (path / TRAINER_STATE_FILE).write_text(json.dumps({"step": step, "files": files}))
    return path


def test_resume_auto_skips_incomplete_states_and_says_why(tmp_path):
    parts = {"model.safetensors": b"x" * 10, "shard/__1_0.distcp": b"y" * 5}
    whole = fake_state(tmp_path, 8, parts)
    missing = fake_state(tmp_path, 16, parts)
    (missing / "shard" / "__1_0.distcp").unlink()
    short = fake_state(tmp_path, 24, parts)
    (short / "model.safetensors").write_bytes(b"x" * 3)
    no_list = step_dir(tmp_path, 32)
    no_list.mkdir()
    (no_list / TRAINER_STATE_FILE).write_text('{"step": 32}')
    step_dir(tmp_path, 40).mkdir()  # renamed in, never given its trainer state

    said: list[str] = []
    assert resolve_resume(tmp_path, "auto", said.append) == whole
    assert said == [
        f"resume: skipping {step_dir(tmp_path, 40)}: no {TRAINER_STATE_FILE}",
        f"resume: skipping {no_list}: {TRAINER_STATE_FILE} has no file list",
        f"resume: skipping {short}: model.safetensors has 3 bytes, 10 were written",
        f"resume: skipping {missing}: shard/__1_0.distcp is missing",
    ]
    assert resolve_resume(tmp_path, "never") is None
    assert resolve_resume(tmp_path / "empty", "auto") is None
    with pytest.raises(ConfigError, match=r"--resume .*step-00000024: not a complete .*"
                                          r"model.safetensors has 3 bytes"):
        resolve_resume(tmp_path, str(short))


def test_leftovers_of_killed_saves_and_rotations_are_removed(tmp_path):
    fake_state(tmp_path, 8, {"a": b"1"})
    for name in (".step-00000016.tmp", ".step-00000008.old", ".step-00000016.old-123"):
        (tmp_path / "state" / name / "sub").mkdir(parents=True)
    said: list[str] = []
    remove_leftovers(tmp_path, said.append)
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["step-00000008"]
    assert len(said) == 3 and all("left by a run killed" in line for line in said)


def test_failpoint_specs_are_validated(monkeypatch):
    assert failpoints.parse("save-shard@16@1") == ("save-shard", 16, 1)
    assert failpoints.parse("step@3") == ("step", 3, None)
    for bad in ("save@16", "step", "step@x", "step@1@2@3"):
        with pytest.raises(ValueError, match="expected PHASE@STEP"):
            failpoints.parse(bad)
    monkeypatch.setenv(failpoints.ENV, "save@16")
    with pytest.raises(ValueError, match="LATHE_FAILPOINT='save@16'"):
        failpoints.check_env()
    monkeypatch.setenv(failpoints.ENV, "eval@5@1")
    failpoints.failpoint("eval", 5, rank=0)  # another rank: nothing happens
    failpoints.failpoint("eval", 4, rank=1)  # another step
    failpoints.failpoint("step", 5, rank=1)  # another phase


def test_torn_metrics_line_is_dropped_on_resume(tmp_path):
    class Main:
        is_main_process = True

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    MetricsLog(path, Main()).truncate_after(2)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'


def test_a_fresh_start_forgets_an_earlier_run_in_the_same_folder(corpus, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 3, "loss": 9.0}\n')
    pretrain(build(run_config(corpus, out, max_steps=4)), resume="auto")
    assert sorted(step_losses(out)) == [1, 2, 3, 4]
    assert step_losses(out)[3] != 9.0
