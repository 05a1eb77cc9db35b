"""Short post-training runs on a tiny model: each stage moves its metric the right way,
LoRA exports merge exactly, and KTO runs on 2 CPU processes."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from lathe.core.cli import main
from lathe.data.chat_encoding import chat_encoder
from lathe.data.formats import PreferenceRow, load_prompt_dataset
from lathe.data.tasks import task_examples
from lathe.model import load_checkpoint
from lathe.model.lora import load_adapter
from lathe.model.transformer import IGNORE_INDEX
from lathe.posttrain.common import PromptFit, ShuffledBatches
from lathe.posttrain.dpo import tokenize_pairs
from tests import processes
from tests.posttrain.conftest import killed_and_resumed, quick

ROOT = Path(__file__).resolve().parents[2]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_sft_lowers_heldout_assistant_loss_and_lora_export_merges(base, tmp_path):
    out = tmp_path / "sft"
    assert main(["sft", *quick(out, base, max_steps=24, **{
        "optim.lr": 3e-3, "eval.every": 24, "lora.enabled": "true", "lora.r": 8})]) == 0
    result = summary(out)
    assert result["heldout_loss"][-1] < 0.9 * result["heldout_loss"][0]
    merged = load_checkpoint(out / "final")
    adapter = load_adapter(load_checkpoint(base), out / "final-adapter")
    ids = torch.randint(0, 400, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapter(ids).logits, atol=1e-5,
                                   rtol=1e-5)
        assert not torch.allclose(merged(ids).logits, load_checkpoint(base)(ids).logits)
    assert (out / "final" / "tokenizer_config.json").is_file()
    assert json.loads((out / "final" / "lathe.json").read_text())["stage"] == "sft"


def test_sft_stops_once_heldout_accuracy_reaches_stop_at(base, tmp_path, capsys):
    """One question to learn: the answer is memorised within a few evaluations, and the run
    ends there rather than at max_steps, with its final checkpoint exported."""
    chats, prompts = tmp_path / "chats.jsonl", tmp_path / "prompts.jsonl"
    chat = {"messages": [{"role": "user", "content": "What is 2 + 2?"},
                         {"role": "assistant", "content": "4"}]}
    chats.write_text((json.dumps(chat) + "\n") * 4)
    prompts.write_text(json.dumps({"prompt": "What is 2 + 2?", "reference": "4"}) + "\n")
    out = tmp_path / "sft"
    assert main(["sft", *quick(out, base, max_steps=400, micro_batch_size=4, **{
        "optim.lr": 3e-3, "eval.every": 5, "data.train": chats, "data.eval": chats,
        "task_eval.prompts": prompts, "task_eval.stop_at": 1.0})]) == 0
    result = summary(out)
    assert result["accuracy"][0] == 0.0 and result["accuracy"][-1] == 1.0
    assert result["accuracy"][:-1] == [0.0] * (len(result["accuracy"]) - 1)  # stopped at once
    assert result["steps"] == 5 * (len(result["accuracy"]) - 1) < 400
    assert (out / "final" / "model.safetensors").is_file()
    assert main(["sft", *quick(tmp_path / "bad", base, **{"task_eval.stop_at": 1.5})]) == 2
    assert "task_eval.stop_at=1.5: an accuracy in (0, 1]" in capsys.readouterr().err
    assert main(["sft", *quick(tmp_path / "bad", base, **{"task_eval.cooldown_steps": 5})]) == 2
    assert "task_eval.cooldown_steps=5 begins when task_eval.stop_at" in capsys.readouterr().err
    assert main(["sft", *quick(tmp_path / "bad", base, router_aux_loss_coef=0.01)]) == 2
    assert "router_aux_loss_coef=0.01: " in capsys.readouterr().err  # a dense model
    assert main(["dpo", *quick(tmp_path / "bad", base, router_aux_loss_coef=-1)]) == 2
    assert "router_aux_loss_coef=-1.0 must be a number >= 0" in capsys.readouterr().err
    assert main(["rm", *quick(tmp_path / "bad", base, router_aux_loss_coef=0.01)]) == 2
    assert "a reward model's loss has no balance term" in capsys.readouterr().err


def test_sft_cools_down_after_stop_at_and_resumes_inside_the_cooldown(base, tmp_path):
    """With cooldown_steps, reaching stop_at starts a linear fall of the rate to the floor
    over that many steps, and the run ends after them; a run killed inside the cooldown
    and resumed ends at the same step with the same rates and the same weights."""
    chats, prompts = tmp_path / "chats.jsonl", tmp_path / "prompts.jsonl"
    chat = {"messages": [{"role": "user", "content": "What is 2 + 2?"},
                         {"role": "assistant", "content": "4"}]}
    chats.write_text((json.dumps(chat) + "\n") * 4)
    prompts.write_text(json.dumps({"prompt": "What is 2 + 2?", "reference": "4"}) + "\n")
    settings = {"max_steps": 400, "micro_batch_size": 4, "optim.lr": 3e-3, "eval.every": 5,
                "data.train": chats, "data.eval": chats, "task_eval.prompts": prompts,
                "task_eval.stop_at": 1.0, "task_eval.cooldown_steps": 6,
                "schedule.kind": "constant", "schedule.min_lr_ratio": 0.1}
    command = [sys.executable, "-m", "lathe.posttrain.sft"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(["sft", *quick(whole, base, **settings)]) == 0
    result = summary(whole)
    reached = 5 * result["accuracy"].index(1.0)
    assert 0 < reached and result["steps"] == reached + 6 < 400
    rates = {r["step"]: r["lr"] for r in map(json.loads, (whole / "metrics.jsonl").open())
             if "lr" in r}
    assert rates[reached] == pytest.approx(3e-3)
    assert [rates[reached + k] for k in range(1, 7)] == pytest.approx(
        [3e-3 * (1 - 0.9 * k / 6) for k in range(1, 7)])
    assert result["accuracy"][-1] == 1.0  # the evaluation at its end is recorded
    saving = quick(killed, base, **settings, **{"checkpoint.every": reached + 2})
    kill = dict(os.environ, LATHE_FAILPOINT=f"step@{reached + 4}")  # saved 2 steps in
    failed = processes.run([*command, *saving], timeout=300, cwd=ROOT, check=False, env=kill)
    assert failed.returncode != 0
    processes.run([*command, *saving, "--resume", "auto"], timeout=300, cwd=ROOT)
    assert summary(killed)["steps"] == result["steps"]
    resumed = {r["step"]: r["lr"] for r in map(json.loads, (killed / "metrics.jsonl").open())
               if "lr" in r}
    assert resumed == pytest.approx(rates)
    torch.testing.assert_close(load_checkpoint(killed / "final").state_dict(),
                               load_checkpoint(whole / "final").state_dict(), atol=1e-6,
                               rtol=1e-6)


def test_the_held_out_task_is_off_on_your_own_data_and_when_examples_is_0(base, tmp_path,
                                                                          capsys):
    """A model fine-tuned on a user's chats is not scored on lathe's arithmetic unless asked:
    unset, task_eval.examples is 64 on task:NAME data and 0 (off) on anything else; an
    explicit 0 turns it off on tasks too, and stop_at without it is refused."""
    from lathe.core.config import from_dict
    from lathe.posttrain.config import GRPOConfig, SFTConfig

    assert SFTConfig().task_eval.examples == 64
    assert from_dict(SFTConfig, {"data": {"train": "my_chats.jsonl"}}).task_eval.examples == 0
    assert from_dict(SFTConfig, {"data": {"train": [{"source": "task:arithmetic"}, {
        "source": "hf:org/chats"}]}}).task_eval.examples == 0
    assert from_dict(GRPOConfig, {"prompts": "task:arithmetic3+arithmetic3x3"}
                     ).task_eval.examples == 64
    chats = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "Say hi."},
                         {"role": "assistant", "content": "hi"}]}
    chats.write_text((json.dumps(chat) + "\n") * 8)
    own = [arg for arg in quick(tmp_path / "own", base, max_steps=2, micro_batch_size=4,
                                **{"data.train": chats, "data.eval": chats})
           if not arg.startswith("--task_eval.examples")]
    assert main(["sft", *own]) == 0
    printed = capsys.readouterr().out
    assert "arithmetic accuracy off" in printed and "accuracy off -> off" in printed
    assert all(math.isnan(a) for a in summary(tmp_path / "own")["accuracy"])
    assert main(["sft", *quick(tmp_path / "zero", base, max_steps=2, **{
        "task_eval.examples": 0, "data.limit": 64})]) == 0
    assert "accuracy off -> off" in capsys.readouterr().out
    assert main(["sft", *quick(tmp_path / "bad", base, **{"task_eval.examples": 0,
                                                           "task_eval.stop_at": 0.5})]) == 2
    assert "task_eval.stop_at=0.5 needs the held-out evaluation" in capsys.readouterr().err


def preference_files(folder: Path) -> dict[str, Path]:
    """Arithmetic prompts where the chosen reply answers and the rejected one refuses: a
    preference a tiny model can learn from some pairs and apply to held-out ones."""
    files = {}
    for split in ("train", "test"):
        rows = [{"prompt": r.prompt, "chosen": r.answer, "rejected": "I do not know."}
                for r in task_examples("arithmetic", split, 200)]
        files[split] = folder / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return files


@pytest.mark.parametrize("lora", [False, True])
def test_dpo_raises_heldout_preference_accuracy(base, tmp_path, lora, capsys):
    out, files = tmp_path / "dpo", preference_files(tmp_path)
    overrides = {"optim.lr": 3e-3 if lora else 1e-3, "eval.every": 20, "beta": 0.1,
                 "lora.enabled": str(lora).lower(), "data.train": files["train"],
                 "data.eval": files["test"], "micro_batch_size": 4}
    assert main(["dpo", *quick(out, base, max_steps=20, **overrides)]) == 0
    # 20 steps of 4 pairs, under half of the 200: only those get reference log-probs
    assert "reference log-probs cached for the 80 pairs they draw" in capsys.readouterr().out
    accuracy = summary(out)["preference_accuracy"]
    assert accuracy[0] == 0.0  # policy = reference: no margin yet
    assert accuracy[-1] > 0.6


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_raise_heldout_preference_accuracy(base, tmp_path, loss, capsys):
    out, files = tmp_path / loss, preference_files(tmp_path)
    overrides = {"optim.lr": 1e-3, "eval.every": 20, "loss": loss,
                 "beta": 2.0 if loss == "simpo" else 0.1, "data.train": files["train"],
                 "data.eval": files["test"], "micro_batch_size": 4}
    assert main(["dpo", *quick(out, base, max_steps=20, **overrides)]) == 0
    assert "no reference model" in capsys.readouterr().out
    accuracy = summary(out)["preference_accuracy"]
    assert accuracy[-1] > max(accuracy[0], 0.6)


def test_kto_learns_from_unpaired_labels(base, tmp_path, capsys):
    """The preference pairs as unpaired rows (chosen: desirable, rejected: not), as thumbs
    up and down arrive: held-out completions' implicit rewards take their labels' sign."""
    files = preference_files(tmp_path)
    unpaired = tmp_path / "unpaired.jsonl"
    with unpaired.open("w") as f:
        for line in files["train"].read_text().splitlines():
            row = json.loads(line)
            for key, label in (("chosen", True), ("rejected", False)):
                f.write(json.dumps({"prompt": row["prompt"], "completion": row[key],
                                    "label": label}) + "\n")
    out = tmp_path / "kto"
    overrides = {"optim.lr": 1e-3, "eval.every": 20, "loss": "kto", "beta": 0.1,
                 "data.train": unpaired, "data.eval": files["test"], "micro_batch_size": 8}
    assert main(["dpo", *quick(out, base, max_steps=20, **overrides)]) == 0
    assert "400 examples (200 desirable)" in capsys.readouterr().out
    accuracy = summary(out)["preference_accuracy"]
    assert accuracy[-1] > max(accuracy[0], 0.7)


@pytest.mark.parametrize("world_size", [1, 2])
def test_drawn_by_is_what_the_steps_of_every_rank_draw(world_size):
    examples = [f"example {i}" for i in range(23)]
    for micro_batches in (1, 3, 4, 9, 100):  # from 3 (world_size 2) steps an epoch
        ranks = [ShuffledBatches(examples, 3, 5, rank, world_size) for rank in range(world_size)]
        drawn = {row for _ in range(micro_batches) for batches in ranks
                 for row in batches.next()}
        listed = ranks[-1].drawn_by(micro_batches)  # from any rank, at any position
        assert len(listed) == len(set(listed)) and set(listed) == drawn
    assert sorted(ranks[0].drawn_by(100)) == sorted(examples)  # later epochs draw the rest


def digit_share(completion: str, reference: str) -> float:
    """Partial credit for writing digits: exact answers are ~never sampled by a random tiny
    model, so this reward gives GRPO a signal to climb on arithmetic prompts."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


@pytest.mark.parametrize("options", [{}, {"importance_sampling_level": "sequence"},
                                     {"sampling_correction": "sequence_mask"}],
                         ids=["ppo", "gspo", "sampling-correction"])
def test_grpo_mean_reward_rises(base, tmp_path, options):
    """With PPO's per-token ratio, GSPO's per-completion one, and the sampling gap
    corrected."""
    out = tmp_path / "grpo"
    rewards = '[{name: "tests.posttrain.test_stages:digit_share"}]'
    assert main(["grpo", *quick(out, base, max_steps=16, rewards=rewards, **{
        "optim.lr": 3e-3, "eval.every": 16, "prompts_per_step": 6, "num_generations": 6,
        "max_completion_tokens": 6, **options})]) == 0
    reward = summary(out)["reward"]
    assert sum(reward[-4:]) / 4 > 3 * sum(reward[:4]) / 4


def starts_with_a_digit(completion: str, reference: str) -> float:
    """A pass/fail reward the tiny random model earns rarely: most groups of 4 score all 0."""
    return float(completion[:1].isdigit())


def step_records(out: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


def test_grpo_dynamic_sampling_draws_until_groups_differ(base, tmp_path):
    """Each step draws rounds of 4 prompts until 4 groups whose rewards differ are found or 3
    rounds are spent, then fills up with all-equal groups; a truncated completion's tokens
    carry no loss (overlong filter)."""
    out = tmp_path / "grpo"
    rewards = '[{name: "tests.posttrain.test_stages:starts_with_a_digit"}]'
    assert main(["grpo", *quick(out, base, max_steps=4, rewards=rewards, **{
        "optim.lr": 3e-3, "eval.every": 100, "prompts_per_step": 4, "num_generations": 4,
        "max_completion_tokens": 6, "dynamic_sampling": "true", "overlong": "filter",
        "logging.log_every": 1})]) == 0
    records = step_records(out)
    assert sorted(records) == [1, 2, 3, 4]
    for r in records.values():
        rounds, filled = r["dynamic/rounds"], r["dynamic/filled_share"] * 4
        differing = round(r["dynamic/informative_share"] * rounds * 4)
        assert 1 <= rounds <= 3 and filled == 4 - min(differing, 4)
        assert rounds == 3 or (filled == 0 and differing >= 4)  # stopped early only when full
        assert r["completion/truncated_share"] > 0
    assert any(r["dynamic/rounds"] > 1 for r in records.values())


GRPO_RECIPE = {"dynamic_sampling": "true", "overlong": "soft_penalty", "overlong_buffer": 3,
               "importance_sampling_level": "sequence", "epsilon": 0.05,
               "sampling_correction": "token_truncate", "beta": 0.04}


def test_grpo_resumes_exactly_after_kill_9(base, tmp_path):
    """Killed mid-step 4 with a save at step 2, `--resume auto` redraws the prompts and
    rollouts the killed run drew (dynamic sampling's extra rounds included) and trains to
    the uninterrupted run's losses and rewards."""
    settings = {"optim.lr": 3e-3, "eval.every": 100, "checkpoint.every": 2,
                "logging.log_every": 1, "prompts_per_step": 4, "num_generations": 4,
                "max_completion_tokens": 6, "limit": 256, **GRPO_RECIPE,
                "rewards": '[{name: "tests.posttrain.test_stages:starts_with_a_digit"}]'}
    whole, killed = killed_and_resumed("lathe.posttrain.grpo", base, tmp_path, 6, **settings)
    expected, got = step_records(whole), step_records(killed)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        for key in ("loss", "reward/mean", "dynamic/rounds", "kl"):
            assert got[step][key] == pytest.approx(expected[step][key], abs=1e-6), (step, key)


@pytest.mark.slow
def test_kto_runs_on_two_cpu_processes(base, tmp_path):
    """KTO averages its reference point over both ranks, through the DPO stage's run (whose
    pairs on two ranks start at log 2 under ZeRO-3, and SFT's packed rows on two ranks are
    one process's: test_sharding)."""
    out = tmp_path / "kto"
    files = preference_files(tmp_path)  # unpaired for KTO: "I do not know" undesirable
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes" / "accelerate" / "cpu-ddp.yaml"), "-m", "lathe.posttrain.dpo",
           *quick(out, base, max_steps=12, micro_batch_size=4, **{
               "optim.lr": 2e-3, "eval.every": 12, "loss": "kto",
               "data.train": files["train"], "data.eval": files["test"]})]
    processes.run(cmd, timeout=300, cwd=ROOT)
    done = summary(out)
    assert done["parallel"]["num_processes"] == 2 and done["parallel"]["backend"] == "gloo"
    assert done["preference_accuracy"][-1] > done["preference_accuracy"][0]
    assert load_checkpoint(out / "final").config.n_layers == 2


def test_export_merge_lora_writes_the_merged_checkpoint(base, tmp_path):
    out = tmp_path / "sft"
    assert main(["sft", *quick(out, base, max_steps=3, **{"eval.every": 3,
                                                          "lora.enabled": "true",
                                                          "data.limit": 64})]) == 0
    assert main(["export", str(base), "--merge-lora", str(out / "final-adapter"),
                 "--out", str(tmp_path / "merged")]) == 0
    ids = torch.randint(0, 400, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(tmp_path / "merged")(ids).logits,
                                   load_checkpoint(out / "final")(ids).logits)
    assert main(["export", str(base), "--merge-lora", str(out / "final-adapter"), "--format",
                 "gguf", "--out", str(tmp_path / "merged.gguf")]) == 0
    assert (tmp_path / "merged.gguf").stat().st_size > 0


def step_losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_sft_resumes_exactly_from_saved_state(base, tmp_path):
    settings = {"optim.lr": 2e-3, "eval.every": 100, "checkpoint.every": 3,
                "logging.log_every": 1, "checkpoint.keep_last": 3, "data.limit": 256}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main(["sft", *quick(whole, base, max_steps=6, **settings)]) == 0
    (resumed / "state").mkdir(parents=True)
    shutil.copytree(whole / "state" / "step-00000003", resumed / "state" / "step-00000003")
    assert main(["sft", *quick(resumed, base, max_steps=6, **settings), "--resume",
                 "auto"]) == 0
    expected, got = step_losses(whole), step_losses(resumed)
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(expected[step], abs=1e-6)
    # the evaluation at step 0 happened before the kill; the summary still has it
    for key in ("heldout_loss", "accuracy"):
        assert len(summary(resumed)[key]) == len(summary(whole)[key]) == 2
        assert summary(resumed)[key] == pytest.approx(summary(whole)[key], abs=1e-6)


def long_prompt_file(folder: Path, count: int = 16) -> Path:
    """Arithmetic prompts where every other one carries ~300 tokens of preamble: with 12
    completion tokens they overflow the 128-token context."""
    rows = []
    for i, row in enumerate(load_prompt_dataset("task:arithmetic", "train", count)):
        question = row.prompt[-1]["content"]
        padding = "Think about numbers with care. " * 40 if i % 2 else ""
        rows.append({"prompt": padding + question, "reference": row.reference})
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("overflow", ["drop", "truncate_left"])
def test_grpo_fits_long_prompts_to_max_prompt_length(base, tmp_path, overflow):
    """Prompts past max_prompt_length are dropped or cut on the left, counted in the
    summary; before, the first prompt + completion past the context crashed the run."""
    out = tmp_path / "grpo"
    assert main(["grpo", *quick(out, base, max_steps=2, prompts=long_prompt_file(tmp_path),
                                prompt_overflow=overflow, **{
                                    "prompts_per_step": 4, "num_generations": 2,
                                    "max_completion_tokens": 12})]) == 0
    fit = summary(out)["prompt_fit"]
    assert fit == ({"kept": 8, "truncated": 0, "dropped": 8} if overflow == "drop"
                   else {"kept": 8, "truncated": 8, "dropped": 0})


def test_grpo_refuses_a_prompt_budget_past_the_context(base, tmp_path, capsys):
    assert main(["grpo", *quick(tmp_path / "grpo", base, max_prompt_length=120,
                                max_completion_tokens=12)]) != 0
    assert ("max_prompt_length=120 + max_completion_tokens=12 must fit the model's context of "
            "128 tokens") in capsys.readouterr().err


def test_dpo_fits_prompts_and_counts_what_it_dropped(base):
    encoder = chat_encoder(base)
    rows = [PreferenceRow([{"role": "user", "content": "x " * n}],
                          [{"role": "assistant", "content": "yes"}],
                          [{"role": "assistant", "content": "no"}]) for n in (2, 200)]
    fit = PromptFit(40, "drop")
    pairs = tokenize_pairs(encoder, rows, 64, fit)
    assert len(pairs) == 1 and fit.counts() == {"kept": 1, "truncated": 0, "dropped": 1}
    fit = PromptFit(40, "truncate_left")
    pairs = tokenize_pairs(encoder, rows, 64, fit)
    assert fit.counts() == {"kept": 1, "truncated": 1, "dropped": 0}
    full = encoder.prompt(rows[1].prompt)
    chosen_ids, chosen_labels = pairs[1].chosen
    assert chosen_ids[:40] == full[-40:]  # the question's end and the assistant header
    assert chosen_labels[:40] == [IGNORE_INDEX] * 40 and chosen_labels[40] != IGNORE_INDEX


@pytest.mark.parametrize("staleness", [0, 1], ids=["sync", "async"])
def test_grpo_samples_from_a_server_it_pushes_its_weights_to(base, tmp_path, monkeypatch,
                                                             staleness):
    """rollout.url: every step's rollouts come from lathe serve's engine, which takes the
    policy's weights after each step (POST /update_weights) — at the end the server's greedy
    tokens are the exported policy's. Asynchronous (max_staleness 1), each step after the
    first trains on rollouts sampled while the step before trained, and the reward still
    climbs."""
    from lathe.model.generate import generate
    from tests.serve.conftest import API_KEY, served
    pushes = tmp_path / "pushes"
    pushes.mkdir()
    monkeypatch.setenv("LATHE_ROLLOUT_API_KEY", API_KEY)
    out = tmp_path / "grpo"
    rewards = '[{name: "tests.posttrain.test_stages:digit_share"}]'
    with served(base, api_key=API_KEY, weight_roots=[pushes]) as url:
        assert main(["grpo", *quick(out, base, max_steps=16, rewards=rewards, **{
            "optim.lr": 3e-3, "eval.every": 16, "prompts_per_step": 6, "num_generations": 6,
            "max_completion_tokens": 6, "rollout.url": url, "rollout.weights_dir": pushes,
            "rollout.max_staleness": staleness, "logging.log_every": 1,
            "sampling_correction": "token_truncate" if staleness else "none"})]) == 0
        reward = summary(out)["reward"]
        assert sum(reward[-4:]) / 4 > 3 * sum(reward[:4]) / 4
        stale = [r.get("rollout/staleness", 0.0) for r in step_records(out).values()]
        assert stale == [0.0] + [float(staleness)] * 15
        import httpx
        answer = httpx.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": "What is 3 + 4?", "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}, headers={"Authorization": f"Bearer {API_KEY}"}).json()
        prompt = answer["choices"][0]["prompt_token_ids"]
        policy = load_checkpoint(out / "final")
        expected = generate(policy, torch.tensor([prompt]), 8)[0].tolist()
        assert answer["choices"][0]["token_ids"] == expected[:len(answer["choices"][0][
            "token_ids"])]
        assert answer["choices"][0]["weight_version"] == 17  # drawn by the last push
    # each rollout knows the weights that drew it: one version a step when synchronous,
    # at most two when a push lands while the next step samples
    spread = {r["rollout/policy_version_spread"] for r in step_records(out).values()}
    assert spread <= ({0.0, 1.0} if staleness else {0.0})
    assert [p.name for p in pushes.iterdir()] == ["push-000017"]  # the start's and 16 steps'


def test_synchronous_rollouts_from_a_server_are_the_in_process_engines(base, tmp_path):
    """Where the rollouts are sampled is all rollout.url changes: a synchronous run on a
    server of its own draws, step for step, the rewards the in-process engine draws from the
    same seeds, and ends on the same policy."""
    rewards = '[{name: "tests.posttrain.test_stages:digit_share"}]'
    settings = {"optim.lr": 3e-3, "eval.every": 4, "prompts_per_step": 4,
                "num_generations": 4, "max_completion_tokens": 6, "rewards": rewards}
    runs = {}
    for where in ("engine", "server"):
        out = tmp_path / where
        extra = {"rollout.url": "local"} if where == "server" else {}
        assert main(["grpo", *quick(out, base, max_steps=4, **settings, **extra)]) == 0
        runs[where] = summary(out)
    assert runs["server"]["reward"] == runs["engine"]["reward"]
    assert runs["server"]["heldout_accuracy"] == runs["engine"]["heldout_accuracy"]
    assert len(set(runs["engine"]["reward"])) > 1  # the policy moved between the steps
    engine = load_checkpoint(tmp_path / "engine" / "final").state_dict()
    for name, weight in load_checkpoint(tmp_path / "server" / "final").state_dict().items():
        assert torch.equal(weight, engine[name]), name


def test_asynchronous_dynamic_sampling_draws_the_synchronous_runs_prompts(base, tmp_path):
    """With a policy that does not move (lr 1e-30: no update survives fp32 rounding),
    stale weights are the current ones, so an asynchronous run with dynamic sampling (its
    first round drawn in the background, the further rounds when the step asks) must draw
    what a synchronous run draws: the same rounds and rewards, step for step."""
    rewards = '[{name: "tests.posttrain.test_stages:starts_with_a_digit"}]'
    settings = {"optim.lr": 1e-30, "eval.every": 100, "prompts_per_step": 4,
                "num_generations": 4, "max_completion_tokens": 6, "rewards": rewards,
                "dynamic_sampling": "true", "sampling_correction": "token_truncate",
                "logging.log_every": 1}
    runs = {}
    for where, extra in (("sync", {}), ("async", {"rollout.url": "local",
                                                  "rollout.max_staleness": 1})):
        assert main(["grpo", *quick(tmp_path / where, base, max_steps=4, **settings,
                                    **extra)]) == 0
        runs[where] = step_records(tmp_path / where)
    assert [r["rollout/staleness"] for r in runs["async"].values()] == [0.0, 1.0, 1.0, 1.0]
    for key in ("dynamic/rounds", "reward/mean", "dynamic/informative_share"):
        assert [r[key] for r in runs["async"].values()] == [r[key] for r in
                                                             runs["sync"].values()], key
    assert any(r["dynamic/rounds"] > 1 for r in runs["sync"].values())


def test_a_lora_policy_pushes_its_adapters_alone_to_the_server(base, tmp_path):
    """rollout.url=local with LoRA: each step's adapters go to the server as a peft folder
    it loads under a name of its own (policy-N), never merged full weights; the server keeps
    the last two, and the last is the trained policy's adapter."""
    from safetensors.torch import load_file
    out = tmp_path / "grpo"
    rewards = '[{name: "tests.posttrain.test_stages:digit_share"}]'
    assert main(["grpo", *quick(out, base, max_steps=4, rewards=rewards, **{
        "optim.lr": 3e-3, "eval.every": 4, "prompts_per_step": 4, "num_generations": 4,
        "max_completion_tokens": 6, "rollout.url": "local", "lora.enabled": "true",
        "lora.r": 8, "logging.log_every": 1})]) == 0
    pushed = sorted(p.name for p in (out / "rollout-weights").iterdir())
    assert pushed == ["policy-4", "policy-5"]  # the start's push and 4 steps', two held
    last = load_file(out / "rollout-weights" / "policy-5" / "adapter_model.safetensors")
    final = load_file(out / "final-adapter" / "adapter_model.safetensors")
    assert last.keys() == final.keys()
    for name in final:
        torch.testing.assert_close(last[name], final[name])


def test_asynchronous_grpo_on_a_server_of_its_own(base, tmp_path):
    """rollout.url=local: the run starts lathe serve on the policy in a process of its own,
    samples each next step there while this one trains, and stops it at the end."""
    out = tmp_path / "grpo"
    rewards = '[{name: "tests.posttrain.test_stages:digit_share"}]'
    assert main(["grpo", *quick(out, base, max_steps=8, rewards=rewards, **{
        "optim.lr": 3e-3, "eval.every": 8, "prompts_per_step": 6, "num_generations": 6,
        "max_completion_tokens": 6, "rollout.url": "local", "rollout.max_staleness": 1,
        "sampling_correction": "token_truncate", "logging.log_every": 1})]) == 0
    stale = [r["rollout/staleness"] for r in step_records(out).values()]
    assert stale == [0.0] + [1.0] * 7
    reward = summary(out)["reward"]
    assert sum(reward[-3:]) > sum(reward[:3])
    assert [p.name for p in (out / "rollout-weights").iterdir()] == ["push-000009"]
    left = set(processes.descendants(os.getpid())) & set(processes.running(b"lathe.core.cli"))
    assert not left  # the server stopped with the run
