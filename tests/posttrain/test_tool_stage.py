"""The README run's tool stage, its recipes on a tiny model: SFT on calculator chats
teaches the call; GRPO with multi-turn tool rollouts runs two steps under bf16 autocast,
running the calls it samples; the result is served with the hermes parser and `lathe chat
--tool calculator` answers through the OpenAI tool-calling API, running the call itself; the
same tool episodes run on a server GRPO pushes its weights to (rollout.url)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lathe.core.cli import main
from lathe.model import ModelConfig, Transformer, load_checkpoint, save_checkpoint
from tests.builders import reset_accelerate
from tests.posttrain.conftest import quick
from tests.serve.conftest import API_KEY, served

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool_base(base, tmp_path_factory) -> Path:
    """`base`'s tokenizer on a two-layer model with room for the calculator's chats."""
    config = load_checkpoint(base).config
    small = ModelConfig.from_preset("tiny", vocab_size=config.vocab_size, n_layers=2, dim=64,
                                    n_heads=2, n_kv_heads=1, ffn_hidden_dim=128,
                                    max_seq_len=512)
    torch.manual_seed(0)
    return save_checkpoint(Transformer(small), tmp_path_factory.mktemp("tools") / "base",
                           tokenizer=base)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_readme_tool_stage(tool_base, tmp_path, capsys, monkeypatch):
    sft = tmp_path / "sft-tools"
    assert main(["sft", "--config", str(ROOT / "recipes/sft/tools.yaml"), *quick(
        sft, tool_base, max_steps=300, micro_batch_size=8, **{
            "optim.lr": 3e-3, "data.limit": 640, "data.max_len": 512, "eval.every": 300,
            "task_eval.max_tokens": 80, "task_eval.examples": 4})]) == 0
    reset_accelerate()  # the next stage asks for bf16

    grpo = tmp_path / "grpo-tools"
    assert main(["grpo", "--config", str(ROOT / "recipes/grpo/tools.yaml"), *quick(
        grpo, sft / "final", max_steps=2, prompts_per_step=2, num_generations=2, limit=40,
        temperature=0.2, max_completion_tokens=200, **{
            "precision.mixed_precision": "bf16", "task_eval.examples": 2, "eval.every": 2})]) == 0
    steps = [r for r in records(grpo) if "tools/calls_per_episode" in r]
    assert len(steps) == 2
    assert all(r["tools/calls_per_episode"] > 0 for r in steps)  # calls were sampled and run
    assert all(r["tools/turns_per_episode"] > 1 for r in steps)  # and answered

    pushes = tmp_path / "pushes"  # the same episodes from a server the policy is pushed to
    pushes.mkdir()
    monkeypatch.setenv("LATHE_ROLLOUT_API_KEY", API_KEY)
    with served(sft / "final", api_key=API_KEY, weight_roots=[pushes]) as url:
        remote = tmp_path / "grpo-remote"
        assert main(["grpo", "--config", str(ROOT / "recipes/grpo/tools.yaml"), *quick(
            remote, sft / "final", max_steps=1, prompts_per_step=2, num_generations=2, limit=40,
            temperature=0.2, max_completion_tokens=200, **{
                "precision.mixed_precision": "bf16", "task_eval.examples": 2,
                "eval.every": 2, "rollout.url": url, "rollout.weights_dir": pushes})]) == 0
    steps = [r for r in records(remote) if "tools/calls_per_episode" in r]
    assert steps[0]["tools/calls_per_episode"] > 0 and steps[0]["tools/turns_per_episode"] > 1

    with served(grpo / "final", tool_call_parser="hermes") as url:
        capsys.readouterr()
        assert main(["chat", url, "--tool", "calculator", "--prompt", "What is 382 + 247?",
                     "--max-tokens", "80", "--temperature", "0"]) == 0
    shown = capsys.readouterr().out
    assert "[tool call calculator(" in shown and "[calculator -> " in shown
