"""Multi-process runs on CPU (2 processes, gloo) through `accelerate launch`: DDP, FSDP2 and
DeepSpeed ZeRO-1/2/3 each assert their setup and match one process with the same global
batch; runs SIGKILLed at every phase of a step resume to one uninterrupted process's
losses (every backend but ZeRO-1, whose files are ZeRO-2's, is matched so, killed and
resumed: a launch each, not two), and killing the launcher takes every rank with it; FSDP2
and ZeRO-3 exports gather into checkpoints that transformers loads with lathe's logits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from lathe.model.checkpoint import load_checkpoint
from lathe.pretrain.runtime.state import published_states
from lathe.pretrain.train import pretrain
from tests import processes
from tests.builders import reset_accelerate
from tests.pretrain.conftest import build, run_config, step_losses

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
STEPS, EVERY = 24, 8
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
    """`accelerate launch` of `recipe`; "cpu", one process, runs as `lathe pretrain` does
    (the README's run), without a launcher."""
    path = Path(config["out_dir"]).with_suffix(".yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    launcher = [] if recipe == "cpu" else [
        "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "recipes" / "accelerate" / f"{recipe}.yaml")]
    return [sys.executable, *launcher, "-m", "lathe.pretrain", "--config", str(path),
            "--resume", resume]


def run(cmd: list[str], failpoint: str | None = None) -> str:
    """Run `cmd` to the end (or, with `failpoint`, to its kill there); return its output."""
    env = dict(os.environ, LATHE_FAILPOINT=failpoint) if failpoint else None
    result = processes.run(cmd, timeout=300, check=failpoint is None, cwd=ROOT, env=env)
    output = result.stdout + result.stderr
    if failpoint:
        phase, step = failpoint.split("@")[:2]
        assert f"lathe failpoint: SIGKILL at {phase}@{step}" in output, output
        assert result.returncode != 0, output
    return output


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """One process, the same global batch (8 windows per step) as 2 processes × 4."""
    out = tmp_path_factory.mktemp("single") / "run"
    reset_accelerate()
    pretrain(build(settings(corpus, out, micro_batch_size=8)))
    return out


@pytest.mark.parametrize("recipe", ["cpu-zero1"])
def test_two_processes_match_one(recipe, corpus, tmp_path, reference):
    """ZeRO-1, the one setup no kill test runs: its setup as asked, and the one-process
    losses, evals and weights."""
    out = tmp_path / recipe
    run(command(recipe, settings(corpus, out, micro_batch_size=4)))
    matches_one(recipe, out, reference)


def matches_one(recipe: str, out: Path, reference: Path) -> None:
    """The two-process run in `out` reports `recipe`'s setup and computes the one-process
    run's losses, evals and final weights (fp32 all-reduce order differs from one process's
    sum: measured max 1e-6 on the losses)."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parallel"] | SETUPS[recipe] == summary["parallel"]
    assert summary["parallel"]["num_processes"] == 2
    assert summary["parallel"]["backend"] == "gloo"
    one, two = step_losses(reference), step_losses(out)
    assert sorted(two) == list(range(1, STEPS + 1))
    assert max(abs(one[s] - two[s]) for s in one) < 1e-5
    one_val, two_val = step_losses(reference, "val/loss"), step_losses(out, "val/loss")
    assert sorted(two_val) == sorted(one_val)
    assert max(abs(one_val[s] - two_val[s]) for s in one_val) < 1e-5
    single = load_checkpoint(reference / "final").state_dict()
    gathered = load_checkpoint(out / "final").state_dict()
    assert max((gathered[k] - single[k]).abs().max().item() for k in single) < 1e-4


def loads_in_transformers(final: Path) -> None:
    from transformers import LlamaForCausalLM

    ours = load_checkpoint(final)
    theirs = LlamaForCausalLM.from_pretrained(final).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


# One run killed at each moment of a step that matters, every kill followed by
# `--resume auto`: a rank mid-step, a rank mid-eval, each rank having written its part of a
# save (the other maybe not), a save whose parts are all written but not published, a
# rotation that has hidden the old state but not deleted it. keep_last=1, so rotations
# happen mid-run. (failpoint, the newest state left after the kill, what the next run says)
KILLS = [
    ("save-publish@8", None, "removing .step-00000008.tmp"),
    ("step@10@1", 8, None),
    ("eval@16@0", 8, None),
    ("save-shard@16@0", 8, "removing .step-00000016.tmp"),
    ("save-shard@16@1", 8, "removing .step-00000016.tmp"),
    ("save-rotate@16", 16, "removing .step-00000008.old"),
]
# The kills probe lathe's save protocol, which is one for every backend: one process goes
# through all of them (bit-exact; its one rank makes the two ranks' save kills one);
# DDP through those of a rank other than the first (mid-step) and of each rank writing its
# part. A sharded backend adds only its own files, so FSDP2, ZeRO-2 and ZeRO-3 are killed
# once each, as the second rank writes its part (ZeRO-1 writes ZeRO-2's files: each rank's
# optimizer partition).
STAGE_KILLS = {"cpu": [*KILLS[:4], KILLS[5]], "cpu-ddp": [KILLS[1], *KILLS[3:5]],
               "cpu-fsdp2": KILLS[4:5], "cpu-zero3": KILLS[4:5], "cpu-zero2": KILLS[4:5]}


@pytest.mark.parametrize(("recipe", "micro_batch_size"), [
    ("cpu", 8), ("cpu-ddp", 4), ("cpu-fsdp2", 4), ("cpu-zero2", 4), ("cpu-zero3", 4)])
def test_run_killed_at_each_phase_resumes(recipe, micro_batch_size, corpus, tmp_path,
                                          reference):
    """After each kill and resume, no partial state is left, and the run ends where one
    uninterrupted process does: bit-exact on one process; on two, with the setup asked
    for, to the all-reduce's rounding (so each backend matches one process and resumes
    in the one run); FSDP2's and ZeRO-3's gathered exports load in transformers with
    lathe's logits."""
    out = tmp_path / "killed"
    config = settings(corpus, out, micro_batch_size)
    config["checkpoint"] = {"every": EVERY, "keep_last": 1}
    resume, expected_message = "never", None
    for failpoint, newest, message in STAGE_KILLS[recipe]:
        if recipe == "cpu":  # one process: rank 0 is every rank
            failpoint = "@".join(failpoint.split("@")[:2])
        output = run(command(recipe, config, resume), failpoint)
        if expected_message:
            assert expected_message in output, output
        resume, expected_message = "auto", message
        assert not (out / "summary.json").exists()
        published = [p.name for p in published_states(out)]
        assert published[-1:] == ([f"step-{newest:08d}"] if newest else []), (failpoint,
                                                                              published)
    output = run(command(recipe, config, "auto"))
    assert expected_message in output, output
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in logged if "loss" in r) == list(range(1, STEPS + 1))
    assert sorted(p.name for p in (out / "state").iterdir()) == [f"step-{STEPS:08d}"]
    if recipe != "cpu":
        matches_one(recipe, out, reference)
        if recipe in ("cpu-fsdp2", "cpu-zero3"):
            loads_in_transformers(out / "final")
        return
    assert step_losses(out) == step_losses(reference)
    assert step_losses(out, "val/loss") == step_losses(reference, "val/loss")
    a = load_checkpoint(reference / "final").state_dict()
    b = load_checkpoint(out / "final").state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5


MOE_MODEL = {"family": "qwen3_moe", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
             "max_seq_len": 64, "n_experts": 4, "n_experts_per_token": 2,
             "moe_ffn_hidden_dim": 64, "router_aux_loss_coef": 0.0}
MOE = {"model": {"preset": "tiny", "overrides": MOE_MODEL}}
# GLM-4.5's router, its selection biases moved every step from the loads of both ranks
BALANCED_MOE = {"model": {"preset": "tiny", "overrides": {
    **MOE_MODEL, "family": "glm4_moe", "qk_norm": False, "sigmoid_router": True}},
    "router_bias_update_speed": 0.01}
# Gemma 4's full layers, wider and with one KV head of keys as values, and its stored
# per-layer output scalars (buffers) beside its sliding layers; E2B's per-layer inputs and
# last two layers attending over the first two's keys and values, every layer recomputed in
# the backward (activation checkpointing: the shared keys cross sharded, recomputed layers)
GEMMA4 = {"model": {"preset": "tiny", "overrides": {
    "family": "gemma4_text", "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
    "max_seq_len": 64, "global_n_kv_heads": 1, "global_k_is_v": True,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "per_layer_dim": 16,
    "kv_shared_layers": 2, "double_wide_shared_mlp": True}},
    "precision": {"activation_checkpointing": True}}
# Qwen3.5's Gated DeltaNet layers (three) beside a gated full-attention one, on windows of
# several documents, each from a zero recurrent state, every layer recomputed in the backward;
# under ZeRO-3 its convolution's weight, read outside that module's forward, is gathered too
QWEN3_5 = {"model": {"preset": "tiny", "overrides": {
    "family": "qwen3_5_text", "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
    "max_seq_len": 64}}, "precision": {"activation_checkpointing": True}}


# ZeRO-3 takes GLM-4.5's experts (Qwen3-MoE's under ZeRO-3 too would add nothing: the
# experts are stacked parameters alike), FSDP2 Qwen3-MoE's
@pytest.mark.parametrize(("recipe", "model"), [
    ("cpu-fsdp2", MOE), ("cpu-zero3", BALANCED_MOE), ("cpu-fsdp2", GEMMA4),
    ("cpu-fsdp2", QWEN3_5), ("cpu-zero3", QWEN3_5)],
    ids=["cpu-fsdp2-qwen3_moe", "cpu-zero3-glm4_moe-balanced", "cpu-fsdp2-gemma4",
         "cpu-fsdp2-qwen3_5", "cpu-zero3-qwen3_5"])
def test_moe_on_two_sharded_processes_matches_one(recipe, model, corpus, tmp_path):
    """A mixture of experts, its stacked experts sharded like any parameter, Gemma 4, its
    layers of two widths, and Qwen3.5, its linear-attention layers: the same losses as one
    process, and the gathered export loads in transformers with lathe's logits. The balance
    loss is off here: transformers computes it per forward, over the tokens of one
    micro-batch on one rank, so it is not a sum that splits over ranks exactly. The
    aux-loss-free balance is a sum: its selection biases, updated from both ranks' loads,
    end where one process's do (under ZeRO-3 alone: the loads are all-reduced the same way
    under every backend, and the biases are buffers, which no backend shards)."""
    from transformers import AutoModelForCausalLM
    balanced = model is BALANCED_MOE

    def moe(out: Path, micro_batch_size: int) -> dict:
        config = {**settings(corpus, out, micro_batch_size, steps=8), **model}
        if model is QWEN3_5:
            config["data"] = {**config["data"], "document_mask": True}
        return config

    one = tmp_path / "one"
    reset_accelerate()
    pretrain(build(moe(one, 8)))
    two = tmp_path / "two"
    run(command(recipe, moe(two, 4)))
    ones, twos = step_losses(one), step_losses(two)
    assert sorted(twos) == list(range(1, 9))
    # fp32 reduction order differs across ranks: a few 1e-6 relative over 8 steps
    assert max(abs(ones[s] - twos[s]) / max(1.0, abs(ones[s])) for s in ones) < 1e-5
    ours = load_checkpoint(two / "final")
    theirs = AutoModelForCausalLM.from_pretrained(two / "final").eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 48), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)
    if balanced:
        from lathe.pretrain.expert_balance import selection_biases
        alone = selection_biases(load_checkpoint(one / "final"))
        for bias, reference_bias in zip(selection_biases(ours), alone, strict=True):
            assert bias.abs().max() > 0
            torch.testing.assert_close(bias, reference_bias, atol=1e-6, rtol=0)


def test_killing_the_launcher_kills_every_rank(corpus, tmp_path):
    """SIGKILL to `accelerate launch` alone (a preemption or OOM kill of the launcher) must
    not leave ranks training on as orphans in the out_dir a resumed run will use."""
    out = tmp_path / "run"
    cmd = command("cpu-ddp", settings(corpus, out, micro_batch_size=4, steps=100_000))
    launcher = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not published_states(out):
            assert launcher.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
        ranks = [pid for pid in processes.descendants(launcher.pid)
                 if b"lathe.pretrain" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 2, ranks
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(map(processes.alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(processes.alive, ranks)), "ranks outlived their launcher"
    finally:
        if launcher.poll() is None:
            processes.kill_tree(launcher.pid)


@pytest.mark.parametrize("recipe", ["cpu-zero3"])
def test_a_gemma3_model_trains_sharded_as_on_one_process(recipe, corpus, tmp_path):
    """ZeRO-3 shards another family alike (FSDP2 does Gemma 4's): Gemma 3's sandwich norms,
    q/k norms, sliding and global layers with their own RoPE train on two processes as on
    one, and the gathered export loads in transformers as Gemma3ForCausalLM with lathe's
    logits."""
    from transformers import AutoModelForCausalLM
    family = {"model.overrides.family": "gemma3_text", "model.overrides.sliding_window": 8,
              "model.overrides.layer_types": ["sliding_attention", "full_attention"]}
    single, sharded = tmp_path / "single", tmp_path / recipe
    reset_accelerate()
    pretrain(build(run_config(corpus, single, max_steps=8, **family)))
    run(command(recipe, run_config(corpus, sharded, max_steps=8, micro_batch_size=4,
                                   **family)))
    one, two = step_losses(single), step_losses(sharded)
    assert max(abs(one[s] - two[s]) for s in one) < 1e-5
    ours = load_checkpoint(sharded / "final")
    theirs = AutoModelForCausalLM.from_pretrained(sharded / "final").eval()
    assert type(theirs).__name__ == "Gemma3ForCausalLM"
    ids = torch.randint(0, ours.config.vocab_size, (1, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)
