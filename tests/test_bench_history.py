"""The benches keep their history in a run folder, never in the installed package: every
bench takes --out/--no-write, and the default folder is runs/bench under the working
directory."""

from __future__ import annotations

import argparse
import importlib

import pytest

from lathe.core.bench_history import add_history_arguments, history_folder, record


def test_the_default_history_is_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_history_arguments(parser)
    record("## one\n", history_folder(parser.parse_args([])))
    record("## two", history_folder(parser.parse_args(["--out", "elsewhere"])))
    record("## three", history_folder(parser.parse_args(["--no-write"])))
    assert (tmp_path / "runs/bench/benchmarks-history.md").read_text() == "\n## one\n"
    assert (tmp_path / "elsewhere/benchmarks-history.md").read_text() == "\n## two\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "runs"]


@pytest.mark.parametrize("bench", ["data", "pretrain", "posttrain", "serve", "kernels"])
def test_every_bench_takes_out_and_no_write(bench, capsys):
    module = importlib.import_module(f"lathe.{bench}.bench")
    with pytest.raises(SystemExit):
        module.main(["--help"])
    text = capsys.readouterr().out
    assert "--out OUT" in text and "--no-write" in text
    assert "ROOT" not in vars(module) or bench == "data"  # data reads its recipes from ROOT
