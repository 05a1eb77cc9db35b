"""The `lathe` console script: the subcommand table, init and generate, and their errors."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from lathe.core.cli import commands, main
from lathe.model import generate, load_checkpoint
from tests import processes
from tests.builders import build_tokenizer


def test_every_package_registers_its_subcommands_and_help_lists_them(capsys):
    registered = commands()
    assert {"clean", "tokenizer", "shards", "pretrain", "sft", "dpo", "grpo", "distill",
            "rm", "serve", "chat", "export", "init", "generate"} <= set(registered)
    for name, entry in registered.items():
        assert callable(entry.load()), name
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "  posttrain: distill dpo grpo plan rm sft\n" in out
    listed = {word for line in out.splitlines() if line.startswith("  ") for word in line.split()}
    assert set(registered) <= listed


def test_installed_console_script_runs():
    beside_python = Path(sys.executable).parent / "lathe"
    exe = str(beside_python) if beside_python.exists() else shutil.which("lathe")
    assert exe, "the lathe console script is not installed"
    result = processes.run([exe, "--help"], timeout=60)
    assert "init" in result.stdout and "generate" in result.stdout


def test_unknown_command_exits_2(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_init_then_generate_greedy(tmp_path, capsys):
    out = tmp_path / "ck"
    assert main(["init", "--preset", "tiny", "--out", str(out), "--n_layers=2", "--seed", "3"]) == 0
    assert "tiny llama checkpoint" in capsys.readouterr().out
    model = load_checkpoint(out)
    assert model.config.n_layers == 2
    assert json.loads((out / "lathe.json").read_text())["overrides"] == {"n_layers": 2}

    assert main(["generate", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out.splitlines()[0]
    want = generate(model, torch.tensor([[1, 2, 3]]), 6)[0].tolist()
    assert printed == "continuation ids: " + ",".join(map(str, want))


def test_init_of_a_mixture_of_experts_family(tmp_path, capsys):
    """`lathe init --family qwen3_moe`: 8 experts, 2 a token, written as Qwen3-MoE."""
    out = tmp_path / "moe"
    assert main(["init", "--preset", "tiny", "--family", "qwen3_moe", "--out", str(out),
                 "--n_experts=4"]) == 0
    assert "tiny qwen3_moe checkpoint" in capsys.readouterr().out
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (written["num_experts"], written["num_experts_per_tok"]) == (4, 2)
    assert load_checkpoint(out).config.n_experts == 4


def test_init_with_tokenizer_makes_a_text_servable_checkpoint(tmp_path, capsys):
    tokenizer = build_tokenizer(tmp_path / "tok", vocab_size=300)
    out = tmp_path / "ck"
    assert main(["init", "--preset", "tiny", "--out", str(out), "--tokenizer", str(tokenizer)]) == 0
    assert load_checkpoint(out).config.vocab_size == 300
    assert (out / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["generate", str(out), "--prompt", "hello world", "--max-new-tokens", "4",
                 "--temperature", "0.8", "--top-k", "20", "--seed", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("continuation ids: ") and lines[1].startswith("continuation text:")


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    out = tmp_path / "ck"
    main(["init", "--preset", "tiny", "--out", str(out)])
    capsys.readouterr()
    cases = [
        (["generate", str(out), "--prompt-ids", "1,x"], "must be comma-separated integers"),
        (["generate", str(out), "--prompt-ids", "5000"], "[0, 2048)"),
        (["generate", str(out), "--prompt", "hi"], "has no tokenizer, so pass --prompt-ids"),
        (["generate", str(out), "--prompt-ids", "1", "--max-new-tokens", "300"],
         "exceeds the model's max_seq_len=256"),
        (["generate", str(tmp_path), "--prompt-ids", "1"], "no config.json"),
        (["init", "--preset", "tiny", "--out", str(tmp_path / "x"), "--dim=130"],
         "dim=130 is not divisible by n_heads=4"),
        (["init", "--preset", "tiny", "--out", str(tmp_path / "x"), "--tokenizer", str(tmp_path)],
         "no tokenizer.json"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def test_a_launched_worker_exits_with_its_code_and_its_output_flushed():
    script = ("import atexit, sys\n"
              "from lathe.core.cli import exit_process\n"
              "atexit.register(lambda: print('teardown ran'))\n"
              "print('summary', end='')\n"
              "sys.stderr.write('warning')\n"
              "exit_process(3)\n")
    for world_size, teardown in (("2", False), ("1", True)):
        env = {**os.environ, "WORLD_SIZE": world_size}
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 3
        assert done.stdout.startswith("summary") and done.stderr == "warning"
        assert ("teardown ran" in done.stdout) is teardown, world_size
