"""Post-training on 2 CPU processes, shown rather than assumed: under FSDP2 and ZeRO-3 each
rank holds half of a policy weight and half of the reference's, and under FSDP2 (with
cpu_ram_efficient_loading) only the main process reads them; an SFT step with
accumulation on 2 ranks is the one-process step on the same 8 rows (of chats, or packed);
GRPO with a sharded reference and its rollout engine synced from the shards reproduces the
one-process run, and so does on-policy distillation from a sharded teacher, and a reward
model's training; GRPO's dynamic sampling keeps both ranks drawing the same rounds;
asynchronous GRPO's two ranks share one rollout server the main process starts, pushes to
and stops."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lathe.core.config import load_config
from lathe.model import ModelConfig, Transformer, load_checkpoint, save_checkpoint
from lathe.posttrain.config import DistillConfig, GRPOConfig, SFTConfig
from lathe.posttrain.distill import distill
from lathe.posttrain.grpo import grpo
from lathe.posttrain.sft import sft
from tests import processes
from tests.builders import reset_accelerate, tiny_model
from tests.posttrain.conftest import quick

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
SHARDED = ["cpu-fsdp2", "cpu-zero3"]


def launch(recipe: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "recipes" / "accelerate" / f"{recipe}.yaml"), *args]


def step_metrics(out: Path, key: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


@pytest.mark.parametrize("recipe", SHARDED)
def test_each_rank_holds_half_of_the_policy_and_of_the_reference(recipe, tmp_path):
    """Neither launch holds a whole copy of a model on every rank: FSDP2's second rank builds
    both as skeletons and receives its shards from the first; ZeRO-3 (zero3_init_flag)
    builds them partitioned, the first rank writing each weight from the one copy it reads."""
    checkpoint = save_checkpoint(tiny_model(n_layers=2), tmp_path / "checkpoint")
    processes.run(launch(recipe, "-m", "tests.posttrain.shard_probe", str(checkpoint),
                         str(tmp_path)), timeout=300, cwd=ROOT)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["setup"]["num_processes"] == 2
        assert report["whole_weights"] == (recipe == "cpu-fsdp2" and rank == 0), report
        assert report["policy"] == 0.5 and report["reference"] == 0.5, report
        assert report["reference_trainable"] == 0
        assert report["reference_logits_error"] < 1e-5, report
        assert report["rows_logits_error"] < 1e-5, report
        assert report["chunked_loss_error"] < 1e-5 and not report["logits_made"], report


SFT = {"max_steps": 3, "micro_batch_size": 8, "optim.lr": 2e-3, "eval.every": 100,
       "data.limit": 64}
PACKED = {"data.packing": "true", "data.max_len": 128}  # ~6 chats a row, 11 rows


@pytest.fixture(scope="module")
def sft_one_process(base, tmp_path_factory) -> Callable[[bool], Path]:
    """The one-process run on rows of chats, or on packed rows: run once each, on demand."""
    runs: dict[bool, Path] = {}

    def run(packed: bool) -> Path:
        if packed not in runs:
            runs[packed] = tmp_path_factory.mktemp("sft") / "one"
            reset_accelerate()
            sft(load_config(SFTConfig, None, quick(runs[packed], base, **SFT,
                                                   **(PACKED if packed else {}))))
        return runs[packed]
    return run


# rows of chats under the sharded backends, packed rows (each rank collating its own) under DDP
@pytest.mark.parametrize(("recipe", "packed"), [
    ("cpu-ddp", True), ("cpu-fsdp2", False), ("cpu-zero3", False)])
def test_sft_on_two_ranks_with_accumulation_is_the_one_process_step(recipe, packed, base,
                                                                    tmp_path, sft_one_process):
    """2 ranks × 2 micro-batches of 2 rows = one process's 8: the same loss and gradient
    norm each step, though the rows' assistant-token counts differ per micro-batch."""
    out = tmp_path / recipe
    settings = {**SFT, **(PACKED if packed else {}), "micro_batch_size": 2,
                "grad_accum_steps": 2}
    processes.run(launch(recipe, "-m", "lathe.posttrain.sft", *quick(out, base, **settings)),
                  timeout=300, cwd=ROOT)
    for key in ("loss", "grad_norm"):
        one, two = step_metrics(sft_one_process(packed), key), step_metrics(out, key)
        assert sorted(two) == [1, 2, 3]
        # fp32 reduction order differs across ranks: ~1e-6 relative
        assert max(abs(one[s] - two[s]) / max(1.0, abs(one[s])) for s in one) < 1e-5, (
            key, one, two)


@pytest.mark.parametrize("recipe", SHARDED)
def test_lora_sft_on_two_sharded_ranks_is_the_one_process_step(recipe, base, tmp_path):
    """peft's adapters on a policy FSDP2's second rank built as a skeleton, or that ZeRO-3
    built partitioned: 2 ranks × 4 rows train as one process's 8 (loss and gradient norm
    each step), the adapters starting equal on every rank."""
    lora = {**SFT, "lora.enabled": "true", "optim.lr": 5e-3}
    one = tmp_path / "one"
    reset_accelerate()
    sft(load_config(SFTConfig, None, quick(one, base, **lora)))
    two = tmp_path / recipe
    processes.run(launch(recipe, "-m", "lathe.posttrain.sft",
                         *quick(two, base, **{**lora, "micro_batch_size": 4})),
                  timeout=300, cwd=ROOT)
    for key in ("loss", "grad_norm"):
        first, second = step_metrics(one, key), step_metrics(two, key)
        assert sorted(second) == [1, 2, 3]
        assert max(abs(first[s] - second[s]) / max(1.0, abs(first[s])) for s in first) < 1e-5, (
            key, first, second)


GRPO = {"max_steps": 3, "prompts_per_step": 4, "num_generations": 4,
        "max_completion_tokens": 6, "beta": 0.04, "optim.lr": 5e-3, "eval.every": 100,
        "task_eval.examples": 4, "limit": 256,
        "rewards": '[{name: "tests.posttrain.test_stages:digit_share"}]'}


@pytest.mark.parametrize("recipe", ["cpu-ddp", *SHARDED])
def test_grpo_with_a_sharded_reference_matches_one_process(recipe, base, tmp_path):
    """Each rank samples its half of the step's prompts on its own engine, seeded by each
    prompt's index in the step, from weights gathered from the shards and broadcast (or its
    own, under DDP): the rewards of every step (and the KL to the sharded reference) are the
    one-process run's."""
    one = tmp_path / "one"
    reset_accelerate()
    grpo(load_config(GRPOConfig, None, quick(one, base, **GRPO, grad_accum_steps=2)))
    two = tmp_path / recipe
    processes.run(launch(recipe, "-m", "lathe.posttrain.grpo", *quick(two, base, **GRPO)),
                  timeout=300, cwd=ROOT)
    for key in ("reward/mean", "loss", "kl", "grad_norm"):
        a, b = step_metrics(one, key), step_metrics(two, key)
        assert sorted(b) == [1, 2, 3]
        assert max(abs(a[s] - b[s]) / max(1.0, abs(a[s])) for s in a) < 1e-5, (key, a, b)
    assert step_metrics(one, "kl")[3] > 0  # the policy moved away from the reference
    # the steps drew different rollouts: the comparison above is not of three equal steps
    assert len(set(step_metrics(one, "reward/mean").values())) > 1


def test_asynchronous_grpo_on_two_ranks_shares_one_server_and_draws_the_one_process_rewards(
        base, tmp_path):
    """rollout.url=local under DDP: the main process starts one server, both ranks sample
    their halves of each step there while the step before trains, and the main process
    pushes each step's weights. With a policy that does not move (lr 1e-30: no update
    survives fp32 rounding), stale weights are the current ones, so the rewards are a
    synchronous one-process run's, step for step; and the server stops with the run."""
    settings = {**GRPO, "max_steps": 4, "optim.lr": 1e-30, "beta": 0.0,
                "logging.log_every": 1}
    one = tmp_path / "one"
    reset_accelerate()
    grpo(load_config(GRPOConfig, None, quick(one, base, **settings, grad_accum_steps=2)))
    two = tmp_path / "async"
    processes.run(launch("cpu-ddp", "-m", "lathe.posttrain.grpo", *quick(two, base, **{
        **settings, "rollout.url": "local", "rollout.max_staleness": 1,
        "sampling_correction": "token_truncate"})), timeout=300, cwd=ROOT)
    assert list(step_metrics(two, "rollout/staleness").values()) == [0.0, 1.0, 1.0, 1.0]
    assert set(step_metrics(two, "rollout/policy_version_spread").values()) <= {0.0, 1.0}
    assert step_metrics(two, "reward/mean") == step_metrics(one, "reward/mean")
    assert len(set(step_metrics(one, "reward/mean").values())) > 1  # four different draws
    assert [p.name for p in (two / "rollout-weights").iterdir()] == ["push-000005"]
    # the server stopped with the run
    assert not processes.running(str(two / "rollout-weights").encode())


def test_dpo_under_zero3_bf16_starts_at_log_2(base, tmp_path):
    """DeepSpeed runs the policy with bf16 weights (no autocast); a reference computed any
    other way (fp32, before wrapping) makes the first loss drift off log 2."""
    out = tmp_path / "dpo"
    processes.run(launch("cpu-zero3", "-m", "lathe.posttrain.dpo", *quick(
        out, base, max_steps=1, micro_batch_size=4, **{"precision.mixed_precision": "bf16",
                                                       "task_eval.examples": 4,
                                                       "data.limit": 64})),
        timeout=300, cwd=ROOT)
    first = json.loads((out / "summary.json").read_text())["parallel"]
    assert first["mixed_precision"] == "bf16" and first["zero_stage"] == 3
    assert step_metrics(out, "loss")[1] == pytest.approx(math.log(2), abs=1e-6)
    assert step_metrics(out, "rewards/margins")[1] == 0.0


def test_grpo_dynamic_sampling_keeps_two_ranks_in_step(base, tmp_path):
    """Each rank draws rounds until every rank holds its 2 groups whose rewards differ (one
    collective a round), so both ranks draw the same rounds: the logged round count, a mean
    over the ranks, is a whole number, and every rank's rollouts gather each step."""
    out = tmp_path / "ddp"
    settings = {**GRPO, "max_steps": 3, "dynamic_sampling": "true", "overlong": "filter",
                "logging.log_every": 1,
                "rewards": '[{name: "tests.posttrain.test_stages:starts_with_a_digit"}]'}
    processes.run(launch("cpu-ddp", "-m", "lathe.posttrain.grpo", *quick(out, base, **settings)),
                  timeout=300, cwd=ROOT)
    rounds = step_metrics(out, "dynamic/rounds")
    assert sorted(rounds) == [1, 2, 3]
    assert all(r in (1.0, 2.0, 3.0) for r in rounds.values()), rounds
    assert max(rounds.values()) > 1


# under ZeRO-3 alone: DDP's ranks hold whole teachers and reward models, each rank's half of
# the step computed as one process computes it, which the sharded run shows and more
@pytest.mark.parametrize("recipe", ["cpu-zero3"])
def test_on_policy_distillation_on_two_ranks_is_the_one_process_run(recipe, base, tmp_path):
    """Each rank samples its half of the step's prompts, seeded by their index in the step,
    and scores them against the teacher (sharded under ZeRO-3): the losses, and the held-out
    KL sampled on both ranks' shares, are the one-process run's."""
    config = load_checkpoint(base).config
    torch.manual_seed(1)  # a sharper random teacher on the base's tokenizer
    teacher = save_checkpoint(Transformer(ModelConfig(**{**config.__dict__, "init_std": 0.1})),
                              tmp_path / "teacher", tokenizer=base)
    settings = {"mode": "on_policy", "loss": "reverse_kl", "teacher": teacher, "max_steps": 3,
                "micro_batch_size": 4, "max_completion_tokens": 6, "optim.lr": 3e-3,
                "eval.every": 3, "task_eval.examples": 4, "logging.log_every": 1,
                "data.limit": 256}
    one, two = tmp_path / "one", tmp_path / recipe
    reset_accelerate()
    distill(load_config(DistillConfig, None, quick(one, base, **settings,
                                                   grad_accum_steps=2)))
    processes.run(launch(recipe, "-m", "lathe.posttrain.distill", *quick(two, base, **settings)),
                  timeout=300, cwd=ROOT)
    a, b = step_metrics(one, "loss"), step_metrics(two, "loss")
    assert sorted(b) == [1, 2, 3]
    assert max(abs(a[s] - b[s]) / max(1.0, abs(a[s])) for s in a) < 1e-5, (a, b)
    for key in ("eval/reverse_kl",):
        assert step_metrics(two, key) == pytest.approx(step_metrics(one, key), rel=1e-5)


@pytest.mark.parametrize("recipe", ["cpu-zero3"])
def test_a_reward_model_trains_on_two_ranks_as_on_one(recipe, base, tmp_path):
    """lathe rm on 2 ranks × 2 pairs a micro-batch is the one-process step on the same 4
    pairs (the score head sharded under ZeRO-3), and its export gathers whole."""
    from lathe.model import load_checkpoint
    from lathe.posttrain.config import RMConfig
    from lathe.posttrain.reward_model import reward_model
    from tests.posttrain.test_reward_model import digit_preferences
    files = digit_preferences(tmp_path)
    settings = {"max_steps": 3, "optim.lr": 1e-3, "eval.every": 100,
                "data.train": files["train"], "data.eval": files["test"],
                "logging.log_every": 1}
    one, two = tmp_path / "one", tmp_path / recipe
    reset_accelerate()
    reward_model(load_config(RMConfig, None, quick(one, base, **settings,
                                                   micro_batch_size=4)))
    processes.run(launch(recipe, "-m", "lathe.posttrain.reward_model",
                         *quick(two, base, **settings, micro_batch_size=2)),
                  timeout=300, cwd=ROOT)
    a, b = step_metrics(one, "loss"), step_metrics(two, "loss")
    assert sorted(b) == [1, 2, 3]
    assert max(abs(a[s] - b[s]) / max(1.0, abs(a[s])) for s in a) < 1e-5, (a, b)
    exported = load_checkpoint(two / "final")
    assert exported.config.num_labels == 1 and exported.score.weight.shape[0] == 1
