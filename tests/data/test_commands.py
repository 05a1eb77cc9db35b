"""The data commands through the `lathe` entry point, as the README runs them."""

from __future__ import annotations

import json

from lathe.core.cli import main
from tests.data.corpus import prose, write_jsonl
from tests.data.test_runner import WEB


def test_clean_tokenizer_shards_chain(tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"id": str(i), "text": prose(i)} for i in range(40)])
    assert main(["clean", "--recipe", str(WEB), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "clean"), "--num_proc=1", "--no-progress"]) == 0
    assert "documents: 40 in, 40 out, 0 dropped" in capsys.readouterr().out
    assert main(["tokenizer", "train", "--input", str(tmp_path / "clean"), "--vocab-size",
                 "500", "--output", str(tmp_path / "tok")]) == 0
    report = json.loads((tmp_path / "tok" / "tokenizer_report.json").read_text())
    assert report["vocab_size"] == 500 and report["heldout"]["bytes_per_token"] > 1
    assert main(["shards", "--input", str(tmp_path / "clean"), "--tokenizer",
                 str(tmp_path / "tok"), "--output", str(tmp_path / "shards"), "--num-proc",
                 "1", "--no-progress"]) == 0
    assert (tmp_path / "shards" / "meta.json").exists()


def test_bad_recipe_field_exits_2_with_the_field_named(tmp_path, capsys):
    assert main(["clean", "--recipe", str(WEB), "--input", "stdlib", "--output",
                 str(tmp_path / "o"), "--gopher_quality.min_wordz=3"]) == 2
    assert "gopher_quality.min_wordz" in capsys.readouterr().err
    assert main(["shards", "--input", str(tmp_path), "--tokenizer", str(tmp_path),
                 "--output", str(tmp_path / "s")]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
