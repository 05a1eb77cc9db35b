"""`lathe clean --executor ray` on a local Ray (2 CPUs) against the local executor on the
same input: the same kept documents, in the same parts, and the same statistics."""

from __future__ import annotations

import json

import pytest

from lathe.data.commands import clean_main
from tests.data.test_runner import WEB, make_input, output_docs, write_broken_inputs

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def stats_without_time(folder) -> dict:
    saved = json.loads((folder / "stats.json").read_text())
    for stage in saved["stages"].values():
        stage.pop("seconds")
    return {k: v for k, v in saved.items() if k != "seconds"}


def test_ray_executor_keeps_what_the_local_executor_keeps(tmp_path):
    make_input(tmp_path / "in", files=4)
    write_broken_inputs(tmp_path / "in")
    args = ["--recipe", str(WEB), "--input", str(tmp_path / "in"), "--no-progress",
            "--source.html_field=html", "--num_proc=2"]
    try:
        assert clean_main([*args, "--output", str(tmp_path / "local")]) == 0
        assert clean_main([*args, "--output", str(tmp_path / "ray"), "--executor", "ray"]) == 0
    finally:
        ray.shutdown()
    local, distributed = output_docs(tmp_path / "local"), output_docs(tmp_path / "ray")
    assert distributed == local and len(local) > 10
    assert stats_without_time(tmp_path / "ray") == stats_without_time(tmp_path / "local")
    stages = stats_without_time(tmp_path / "ray")["stages"]
    assert stages["exact_dedup"]["dropped"] and stages["near_dedup"]["dropped"]
    assert stages["read"]["dropped"]["broken_warc_record"] == 1
