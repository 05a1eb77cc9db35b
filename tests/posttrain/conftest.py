"""A tiny base checkpoint (random weights, lathe's tokenizer and chat template) and the
overrides that make every post-training stage a seconds-long CPU run."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from lathe.data.tasks import task_examples
from lathe.data.tokenizer import save_tokenizer, train_tokenizer
from lathe.model import ModelConfig, Transformer, save_checkpoint
from tests.data.corpus import prose


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("posttrain")
    texts = [prose(i, paragraphs=2) for i in range(60)]
    texts += [f"{r.prompt} {r.answer}" for r in task_examples("arithmetic", "train", 300)]
    tokenizer = train_tokenizer(texts, vocab_size=512, max_digits=1, show_progress=False)
    save_tokenizer(tokenizer, root / "tokenizer")
    config = ModelConfig.from_preset("tiny", vocab_size=tokenizer.get_vocab_size(
        with_added_tokens=True), n_layers=2, max_seq_len=128)
    torch.manual_seed(0)
    return save_checkpoint(Transformer(config), root / "base", tokenizer=root / "tokenizer")


def quick(out_dir: Path, model: Path, **extra) -> list[str]:
    """Command-line overrides for a short, quiet, seeded run."""
    settings = {"out_dir": out_dir, "model": model, "logging.report_to": "none",
                "logging.progress": "false", "task_eval.examples": 8, "eval.batches": 2,
                "checkpoint.every": 1000, "schedule.warmup_steps": 2, **extra}
    return [f"--{key}={value}" for key, value in settings.items()]


def killed_and_resumed(module: str, base: Path, root: Path, steps: int, **settings) -> tuple[
        Path, Path]:
    """`module`'s stage run whole (in this process, as `lathe` runs it), and again as `python
    -m module` SIGKILLed in step 4 (`LATHE_FAILPOINT`) then resumed with `--resume auto`:
    the two runs' output folders."""
    from tests import processes
    from tests.builders import reset_accelerate
    cwd = Path(__file__).resolve().parents[2]
    whole, killed = root / "whole", root / "killed"
    command = [sys.executable, "-m", module]
    reset_accelerate()
    assert importlib.import_module(module).main(quick(whole, base, max_steps=steps,
                                                      **settings)) == 0
    result = processes.run([*command, *quick(killed, base, max_steps=steps, **settings)],
                           timeout=300, cwd=cwd, check=False,
                           env=dict(os.environ, LATHE_FAILPOINT="step@4"))
    assert result.returncode != 0 and "SIGKILL at step@4" in result.stdout + result.stderr
    processes.run([*command, *quick(killed, base, max_steps=steps, **settings), "--resume",
                   "auto"], timeout=300, cwd=cwd)
    return whole, killed
