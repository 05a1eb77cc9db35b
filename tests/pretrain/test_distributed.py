"""Multi-process runs on CPU (2 processes, gloo) through `accelerate launch`: DDP, FSDP2 and
DeepSpeed ZeRO-1/2/3 each assert their setup and match one process with the same global
batch; runs SIGKILLed mid-way resume to the uninterrupted losses; FSDP2 and ZeRO-3 exports
gather into checkpoints that transformers loads with lathe's logits."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from lathe.model.checkpoint import load_checkpoint
from lathe.pretrain.state import complete_states
from lathe.pretrain.train import pretrain
from tests.pretrain.conftest import build, reset_accelerate, run_config, step_losses

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
STEPS, EVERY = 24, 8
KILL_STEPS = 160  # long enough (a few seconds) to be killed at a random moment
# recipe -> what describe() must report
SETUPS = {
    "cpu-ddp": {"distributed_type": "MULTI_CPU"},
    "cpu-fsdp2": {"distributed_type": "FSDP", "fsdp_version": 2},
    "cpu-zero1": {"distributed_type": "DEEPSPEED", "zero_stage": 1},
    "cpu-zero2": {"distributed_type": "DEEPSPEED", "zero_stage": 2},
    "cpu-zero3": {"distributed_type": "DEEPSPEED", "zero_stage": 3},
}


def settings(corpus: Path, out: Path, micro_batch_size: int, steps: int = STEPS) -> dict:
    return run_config(corpus, out, max_steps=steps, micro_batch_size=micro_batch_size,
                      **{"checkpoint.every": EVERY, "eval.every": EVERY})


def command(recipe: str, config: dict, resume: str = "never") -> list[str]:
    path = Path(config["out_dir"]).with_suffix(".yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "recipes" / "accelerate" / f"{recipe}.yaml"), "-m", "lathe.pretrain",
            "--config", str(path), "--resume", resume]


def run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def run_and_kill(cmd: list[str], out: Path, delay: float) -> int:
    """Start `cmd`, SIGKILL its whole process group `delay` s after it publishes its first
    new state folder; return the last step it logged."""
    before = {p.name for p in complete_states(out)}
    process = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not {p.name for p in complete_states(out)} - before:
        assert process.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(delay)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (out / "summary.json").exists(), "the run finished before it was killed"
    return max(step_losses(out))


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """One process, the same global batch (8 windows per step) as 2 processes × 4."""
    out = tmp_path_factory.mktemp("single") / "run"
    reset_accelerate()
    pretrain(build(settings(corpus, out, micro_batch_size=8)))
    return out


@pytest.fixture(scope="module")
def two_process_runs(corpus, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("multi")
    outs = {}
    for recipe in SETUPS:
        outs[recipe] = root / recipe
        run(command(recipe, settings(corpus, outs[recipe], micro_batch_size=4)))
    return outs


@pytest.mark.parametrize("recipe", list(SETUPS))
def test_two_processes_match_one(recipe, two_process_runs, reference):
    out = two_process_runs[recipe]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parallel"] | SETUPS[recipe] == summary["parallel"]
    assert summary["parallel"]["num_processes"] == 2
    assert summary["parallel"]["backend"] == "gloo"
    one, two = step_losses(reference), step_losses(out)
    assert sorted(two) == list(range(1, STEPS + 1))
    # fp32 all-reduce order differs from one process's sum: measured max 1e-6
    assert max(abs(one[s] - two[s]) for s in one) < 1e-5
    one_val, two_val = step_losses(reference, "val/loss"), step_losses(out, "val/loss")
    assert max(abs(one_val[s] - two_val[s]) for s in one_val) < 1e-5


@pytest.mark.parametrize("recipe", ["cpu-fsdp2", "cpu-zero3"])
def test_sharded_export_loads_in_transformers(recipe, two_process_runs, reference):
    from transformers import LlamaForCausalLM

    final = two_process_runs[recipe] / "final"
    ours = load_checkpoint(final)
    theirs = LlamaForCausalLM.from_pretrained(final).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)
    single = load_checkpoint(reference / "final").state_dict()
    gathered = ours.state_dict()
    assert max((gathered[k] - single[k]).abs().max().item() for k in single) < 1e-4


@pytest.mark.parametrize(("recipe", "micro_batch_size", "tolerance"), [
    ("cpu", 8, 0.0),  # one process: bit-exact
    ("cpu-ddp", 4, 1e-6),
    ("cpu-fsdp2", 4, 1e-6),
    ("cpu-zero2", 4, 1e-6),
])
def test_run_killed_at_random_moments_resumes(recipe, micro_batch_size, tolerance, corpus,
                                              tmp_path):
    """SIGKILL at seeded random moments (mid-step, mid-eval, mid-save), resume, maybe get
    killed again, resume to the end: the loss sequence is the uninterrupted one."""
    def cmd(out: Path, resume: str) -> list[str]:
        return command(recipe, settings(corpus, out, micro_batch_size, KILL_STEPS), resume)

    run(cmd(tmp_path / "uninterrupted", "never"))
    out = tmp_path / "killed"
    rng = random.Random(recipe)
    died_at = run_and_kill(cmd(out, "never"), out, delay=rng.uniform(0, 1.5))
    assert EVERY <= died_at < KILL_STEPS
    died_again = run_and_kill(cmd(out, "auto"), out, delay=rng.uniform(0, 1.5))
    assert died_again < KILL_STEPS
    run(cmd(out, "auto"))
    resumed, uninterrupted = step_losses(out), step_losses(tmp_path / "uninterrupted")
    assert sorted(resumed) == list(range(1, KILL_STEPS + 1))
    assert max(abs(resumed[s] - uninterrupted[s]) for s in resumed) <= tolerance
    assert not list((out / "state").glob(".step-*"))
    a = load_checkpoint(tmp_path / "uninterrupted" / "final").state_dict()
    b = load_checkpoint(out / "final").state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= max(tolerance, 1e-6) * 10
