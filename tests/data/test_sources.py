"""Every source format yields documents; bad records become named rejections."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lathe.core.errors import ConfigError
from lathe.data.document import Document, Rejected
from lathe.data.sources import SourceConfig, list_shards
from tests.data.corpus import html_page, prose, write_jsonl


def read_all(spec, config=None):
    records = [r for s in list_shards(str(spec), config or SourceConfig()) for r in s.read()]
    return ([r for r in records if isinstance(r, Document)],
            sorted(r.reason for r in records if isinstance(r, Rejected)))


def test_jsonl_plain_and_gzip(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "a1", "text": "hello", "url": "u"}])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "b1", "text": "world"}) + "\n")
    docs, bad = read_all(tmp_path)
    assert [(d.id, d.text) for d in docs] == [("a1", "hello"), ("b1", "world")]
    assert docs[0].metadata == {"url": "u"} and bad == []


def test_bad_records_are_counted_with_reasons(tmp_path):
    path = tmp_path / "bad.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"text": "fine"}\n')
        f.write(b'{"text": "broken json"\n')
        f.write(b'{"text": "caf\xe9 latin-1"}\n')
        f.write(b'{"text": "   "}\n')
        f.write(b'{"body": "no text field"}\n')
        f.write(b'[1, 2]\n')
        f.write(json.dumps({"text": "x" * 10_000_001}).encode() + b"\n")
    docs, bad = read_all(path)
    assert [d.text for d in docs] == ["fine"]
    assert bad == ["empty_text", "invalid_json", "invalid_json", "invalid_utf8",
                   "missing_text", "too_large"]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["p1", "p2"], "content": ["alpha", "beta"]}),
                   tmp_path / "x.parquet")
    docs, _ = read_all(tmp_path / "x.parquet", SourceConfig(text_field="content"))
    assert [(d.id, d.text) for d in docs] == [("p1", "alpha"), ("p2", "beta")]


def test_folder_of_txt_and_html(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.html").write_text(html_page(prose(1)))
    (tmp_path / "c.txt").write_bytes(b"\xff\xfe bad")
    docs, bad = read_all(tmp_path)
    assert sorted((d.text != "", d.html is not None) for d in docs) == [(False, True),
                                                                        (True, False)]
    assert bad == ["invalid_utf8"]


def test_warc_gz_html_responses(tmp_path):
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    path = tmp_path / "crawl.warc.gz"
    with open(path, "wb") as f:
        writer = WARCWriter(f, gzip=True)
        for url, ctype, body in [("http://a.example/", "text/html; charset=utf-8",
                                  html_page(prose(2)).encode()),
                                 ("http://b.example/x.png", "image/png", b"\x89PNG")]:
            headers = StatusAndHeaders("200 OK", [("Content-Type", ctype)], protocol="HTTP/1.0")
            writer.write_record(writer.create_warc_record(
                url, "response", payload=io.BytesIO(body), http_headers=headers))
    docs, bad = read_all(path)
    assert len(docs) == 1 and docs[0].metadata["url"] == "http://a.example/"
    assert "<article>" in docs[0].html and bad == []


@pytest.mark.parametrize("streaming", [False, True])
def test_saved_hf_dataset(tmp_path, streaming):
    import datasets

    datasets.Dataset.from_dict({"id": [f"r{i}" for i in range(10)],
                                "text": [f"row {i}" for i in range(10)]}).save_to_disk(tmp_path)
    docs, _ = read_all(tmp_path, SourceConfig(streaming=streaming, hf_shards=3))
    assert sorted(d.text for d in docs) == [f"row {i}" for i in range(10)]


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_load_dataset_path(tmp_path, streaming):
    """`hf:NAME` goes through datasets.load_dataset, which takes hub names and local paths."""
    write_jsonl(tmp_path / "train.jsonl", [{"text": f"doc {i}"} for i in range(7)])
    docs, _ = read_all(f"hf:{tmp_path}", SourceConfig(streaming=streaming, hf_shards=2))
    assert sorted(d.text for d in docs) == [f"doc {i}" for i in range(7)]


def test_unknown_input_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="neither"):
        list_shards(str(tmp_path / "missing"), SourceConfig())
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ConfigError, match="unknown format"):
        list_shards(str(tmp_path / "x.csv"), SourceConfig())


def test_stdlib_corpus_lists_code_and_pydoc_shards():
    from lathe.data.stdlib_corpus import documented_modules, python_files, read_pydoc_pages

    assert len(python_files()) > 500 and "json" in documented_modules()
    [page] = list(read_pydoc_pages(["json"], SourceConfig()))
    assert page.kind == "prose" and "JSON" in page.html and page.html.startswith("<!DOCTYPE")
    names = [s.name for s in list_shards("stdlib", SourceConfig(files_per_shard=400))]
    assert any(n.startswith("stdlib-py-") for n in names)
    assert any(n.startswith("stdlib-pydoc-") for n in names)


def test_pydoc_pages_are_the_same_in_every_run_and_hold_no_environment(tmp_path):
    """os documents os.environ, sys its argv, ctypes a handle address, aifc its warning
    registry and rlcompleter the main module: none of that may differ between runs or
    worker processes, or leak this machine's environment into the corpus."""
    script = ("import hashlib, multiprocessing, sys, warnings\n"
              "from lathe.data.stdlib_corpus import render_pydoc\n"
              "modules = ('os', 'sys', 'ctypes', 'aifc', 'rlcompleter')\n"
              "if __name__ == '__main__':\n"
              "    if sys.argv[1] == '2':  # a spawned worker, after other warning filters\n"
              "        warnings.filterwarnings('ignore', 'probe')\n"
              "        with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
              "            pages = pool.map(render_pydoc, modules)\n"
              "    else:\n"
              "        pages = [render_pydoc(m) for m in modules]\n"
              "    assert not any('LATHE_PROBE_SECRET' in p or 'sk-probe' in p for p in pages)\n"
              "    print([hashlib.sha256(p.encode()).hexdigest() for p in pages])\n")
    (tmp_path / "render.py").write_text(script)
    outputs = []
    for seed, secret in (("1", "sk-probe-1"), ("2", "sk-probe-2")):
        env = {**os.environ, "PYTHONHASHSEED": seed, "LATHE_PROBE_SECRET": secret}
        done = subprocess.run([sys.executable, str(tmp_path / "render.py"), seed], env=env,
                              text=True,
                              capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]


def test_pydoc_pages_do_not_depend_on_what_the_worker_rendered_before(tmp_path):
    """pyexpat's page shows its error class as xml.parsers.expat's once that is imported,
    asynchat's data section depends on asyncore: a worker's earlier pages changed its later
    ones, so two runs whose shards went to different workers read different documents (and
    wrote different stage counts). Rendered in opposite orders, each page is the same."""
    script = ("import hashlib, sys\n"
              "from lathe.data.stdlib_corpus import render_pydoc\n"
              "modules = ['xml', 'pyexpat', 'asyncore', 'asynchat']\n"
              "order = modules if sys.argv[1] == 'forward' else modules[::-1]\n"
              "pages = {m: hashlib.sha256(render_pydoc(m).encode()).hexdigest() for m in order}\n"
              "print(sorted(pages.items()))\n")
    (tmp_path / "render.py").write_text(script)
    outputs = []
    for order in ("forward", "backward"):
        done = subprocess.run([sys.executable, str(tmp_path / "render.py"), order], text=True,
                              capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]


def test_pydoc_pages_do_not_depend_on_where_python_and_the_checkout_lie():
    """`site` shows the venv's prefix, `platform` the interpreter's path and every page the
    stdlib's location: two clones in different folders must still get one corpus."""
    from lathe.data.stdlib_corpus import render_pydoc

    pages = {name: render_pydoc(name) for name in ("site", "platform", "json")}
    for name, page in pages.items():
        for path in {sys.prefix, sys.base_prefix, sys.executable, str(Path.home())}:
            assert path not in page, (name, path)
    prefix = "/venv" if sys.prefix != sys.base_prefix else "/usr/local"
    assert f"PREFIXES</strong> = ['{prefix}']" in pages["site"]
    assert f"executable='{prefix}/bin/python" in pages["platform"]
    assert "file:/usr/local/lib/python" in pages["json"]
