"""`lathe clean` end to end on small inputs: accounting, dedup across shards, formats,
and a run killed with SIGKILL that resumes to the same output."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from lathe.core.config import load_config
from lathe.core.errors import ConfigError
from lathe.data.pipeline import READ, CleanConfig
from lathe.data.runner import clean
from lathe.data.stats import docs_out
from lathe.data.store import document_files, read_documents
from tests import processes
from tests.data.corpus import html_page, prose, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
WEB = ROOT / "recipes" / "data" / "web.yaml"


def make_input(folder: Path, files: int = 3, per_file: int = 6) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    n = 0
    for f in range(files):
        records = []
        for _ in range(per_file):
            records.append({"id": f"d{n}", "text": prose(n)})
            n += 1
        records.append({"id": f"dup{f}", "text": prose(0)})  # exact copy of d0
        near = prose(1).replace("river", "stream", 1)
        records.append({"id": f"near{f}", "text": near})  # near copy of d1
        records.append({"id": f"short{f}", "text": "Too short to keep."})
        records.append({"id": f"html{f}", "html": html_page(prose(1000 + f))})
        write_jsonl(folder / f"part{f}.jsonl", records)
    with open(folder / "part0.jsonl", "ab") as fh:
        fh.write(b"{not json}\n")


def config(**overrides) -> CleanConfig:
    args = [f"--{k}={v}" for k, v in overrides.items()]
    return load_config(CleanConfig, WEB, ["--num_proc=1", "--source.html_field=html", *args])


def output_docs(folder: Path) -> list[tuple[str, str]]:
    return [(d.id, d.text) for p in document_files(folder) for d in read_documents(p)]


def test_accounting_dedup_and_stats_file(tmp_path):
    make_input(tmp_path / "in")
    result = clean(str(tmp_path / "in"), tmp_path / "out", config(), progress=False)
    stats = result.stats
    dropped = sum(s.docs_dropped for s in stats.values())
    assert stats[READ].docs_in == 3 * 10 + 1
    assert stats[READ].docs_in == docs_out(stats) + dropped
    assert stats[READ].dropped == {"invalid_json": 1}
    # a one-line document is all "top 2-gram" by Gopher's definition
    assert stats["gopher_repetition"].dropped == {"top_2_gram": 3}
    # three copies of d0, and the near copy of d1 repeated in every file: 3 + 2 exact
    assert stats["exact_dedup"].dropped == {"exact_duplicate": 5}
    assert stats["near_dedup"].dropped == {"near_duplicate": 1}
    ids = [i for i, _ in output_docs(tmp_path / "out")]
    assert "d0" in ids and "d1" in ids and not any(i.startswith(("dup", "near")) for i in ids)
    saved = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert saved["docs_in"] == saved["docs_out"] + sum(
        sum(s["dropped"].values()) for s in saved["stages"].values())
    assert not (tmp_path / "out" / ".work").exists()


def test_html_documents_are_extracted(tmp_path):
    make_input(tmp_path / "in", files=1)
    clean(str(tmp_path / "in"), tmp_path / "out", config(), progress=False)
    [(doc_id, text)] = [d for d in output_docs(tmp_path / "out") if d[0].startswith("html")]
    assert doc_id == "html0" and "<p>" not in text and "Home" not in text
    assert text.startswith("The ")


def test_jsonl_output_and_parallel_workers_match_serial(tmp_path):
    make_input(tmp_path / "in")
    clean(str(tmp_path / "in"), tmp_path / "serial", config(), progress=False)
    clean(str(tmp_path / "in"), tmp_path / "par", config(num_proc=2, output_format="jsonl"),
          progress=False)
    assert output_docs(tmp_path / "serial") == output_docs(tmp_path / "par")
    assert all(p.suffix == ".jsonl" for p in document_files(tmp_path / "par"))


def test_refuses_finished_or_mismatched_output(tmp_path):
    make_input(tmp_path / "in", files=1)
    clean(str(tmp_path / "in"), tmp_path / "out", config(), progress=False)
    with pytest.raises(ConfigError, match="finished run"):
        clean(str(tmp_path / "in"), tmp_path / "out", config(), progress=False)
    (tmp_path / "other" / ".work").mkdir(parents=True)
    (tmp_path / "other" / ".work" / "manifest.json").write_text('{"input": "x"}')
    with pytest.raises(ConfigError, match="unfinished run"):
        clean(str(tmp_path / "in"), tmp_path / "other", config(), progress=False)


@pytest.mark.slow
def test_a_run_killed_at_each_phase_resumes_to_the_same_output(tmp_path):
    make_input(tmp_path / "in", files=6, per_file=8)
    args = [sys.executable, "-m", "lathe.core", "clean", "--recipe", str(WEB),
            "--input", str(tmp_path / "in"), "--num_proc=1", "--no-progress",
            "--source.html_field=html"]
    processes.run([*args, "--output", str(tmp_path / "full")], timeout=300)
    full = json.loads((tmp_path / "full" / "stats.json").read_text())

    # (failpoint, what the killed run leaves behind)
    kills = [("clean-shard@3", lambda out: len(list((out / ".work").glob("*.stats.json"))) == 3),
             ("clean-dedup@0", lambda out: not list(out.glob("part-*"))),
             ("clean-part@2", lambda out: len(list(out.glob("part-*"))) == 3),
             ("clean-stats@0", lambda out: (out / "stats.json").exists()
              and (out / ".work").exists())]
    for spec, left in kills:
        out = tmp_path / spec.replace("@", "-")
        killed = processes.run([*args, "--output", str(out)], timeout=300, check=False,
                               env={**os.environ, "LATHE_FAILPOINT": spec})
        assert killed.returncode == -signal.SIGKILL, (spec, killed.stderr[-2000:])
        assert f"lathe failpoint: SIGKILL at {spec}" in killed.stderr
        assert left(out), (spec, sorted(p.name for p in out.rglob("*")))
        processes.run([*args, "--output", str(out)], timeout=300)
        assert output_docs(out) == output_docs(tmp_path / "full"), spec
        assert not (out / ".work").exists()
        resumed = json.loads((out / "stats.json").read_text())
        for name, stage in full["stages"].items():
            for key in ("docs_in", "kept", "dropped", "edits", "chars_in", "chars_out"):
                assert resumed["stages"][name][key] == stage[key], (spec, name, key)


def test_worker_processes_exit_with_a_killed_run(tmp_path):
    """The run's output pipes close only when every worker has exited: before, workers of
    a killed run waited on their task queue for good (and held the pipes and memory)."""
    make_input(tmp_path / "in", files=4, per_file=4)
    killed = processes.run(
        [sys.executable, "-m", "lathe.core", "clean", "--recipe", str(WEB), "--input",
         str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--num_proc=2",
         "--no-progress", "--source.html_field=html"], timeout=60, check=False,
        env={**os.environ, "LATHE_FAILPOINT": "clean-shard@1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]


def write_broken_inputs(folder: Path) -> None:
    """A truncated .jsonl.gz, a WARC cut off inside its second record (warcio raises an
    AttributeError there), and a .parquet file that is not parquet."""
    import gzip
    import io

    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    records = [json.dumps({"id": f"g{i}", "text": prose(200 + i)}) for i in range(40)]
    packed = gzip.compress(("\n".join(records) + "\n").encode())
    (folder / "cut.jsonl.gz").write_bytes(packed[:len(packed) * 2 // 3])
    buffer = io.BytesIO()
    writer = WARCWriter(buffer, gzip=False)
    for url in ("http://a.example/", "http://b.example/"):
        headers = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")],
                                   protocol="HTTP/1.0")
        writer.write_record(writer.create_warc_record(
            url, "response", payload=io.BytesIO(html_page(prose(300)).encode()),
            http_headers=headers))
    data = buffer.getvalue()
    second = data.index(b"WARC/1.", 10)
    (folder / "crawl.warc").write_bytes(data[:second + 60])  # ends inside its headers
    (folder / "table.parquet").write_bytes(b"PAR1 this is not a parquet file")


def test_bad_files_are_counted_failures_and_the_run_goes_on(tmp_path):
    make_input(tmp_path / "in", files=1)
    write_broken_inputs(tmp_path / "in")
    result = clean(str(tmp_path / "in"), tmp_path / "out", config(), progress=False)
    read = result.stats[READ]
    assert read.dropped["truncated_file"] == 1
    assert read.dropped["broken_warc_record"] == 1
    assert read.dropped["unreadable_file"] == 1
    assert read.kept > 10 + 1  # the good file, the cut file's first lines and a WARC page
    stats = result.stats
    assert read.docs_in == docs_out(stats) + sum(s.docs_dropped for s in stats.values())
    saved = json.loads((tmp_path / "out" / "stats.json").read_text())
    failures = {f["reason"]: f for f in saved["stages"][READ]["failures"]}
    assert failures["truncated_file"]["where"].endswith("cut.jsonl.gz")
    assert failures["broken_warc_record"]["where"].split("@")[1].isdigit()
    assert failures["broken_warc_record"]["where"].split("@")[1] != "0"
    assert "table.parquet" in failures["unreadable_file"]["where"]
    from lathe.data.stats import format_table
    table = format_table(stats)
    for stage in saved["stages"].values():
        for reason in stage["dropped"]:
            assert reason in table
    assert "unreadable: " in table and "cut.jsonl.gz" in table
