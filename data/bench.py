"""`python -m lathe.data.bench`: throughput of the data stage on the embedded corpus.

1. per-stage and whole-pipeline docs/s for lathe, side by side with datatrove running the
   equivalent steps (trafilatura extraction, ftfy, Gopher repetition + quality, C4,
   FineWeb, PII) on the same documents in the same process, one core each;
2. the full `lathe clean` run (num_proc workers, dedup included) on the stdlib recipe;
3. MinHash dedup peak memory per 100k documents (a subprocess per size, synthetic docs);
4. BPE training seconds and held-out bytes/token per vocabulary size;
5. shard tokenization MB/s.

Needs the `bench` extra for datatrove (`pip install -e .[bench]`); without it the
datatrove column is skipped.
Results are printed and appended to the history in `--out` (`lathe.core.bench_history`;
`--out docs` from a checkout's root: the project's own). The recipes it cleans with are
read from the checkout.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lathe.core.bench_history import add_history_arguments, history_folder, record
from lathe.core.config import load_config
from lathe.data.document import Document
from lathe.data.pipeline import CleanConfig, Pipeline
from lathe.data.sources import SourceConfig, list_shards

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["extract", "normalize", "gopher_repetition", "gopher_quality", "c4", "fineweb",
          "pii"]


def corpus() -> list[Document]:
    return [r for shard in list_shards("stdlib", SourceConfig()) for r in shard.read()
            if isinstance(r, Document)]


def lathe_stages(docs: list[Document]) -> dict[str, tuple[int, int, float]]:
    """stage -> (docs in, docs kept, seconds). Extraction and normalization run in a chain;
    each filter then sees all their output, so every stage is timed on the same documents."""
    config = load_config(CleanConfig, ROOT / "recipes/data/web.yaml",
                         ["--language=null", "--code=null", "--dedup=null"] +
                         [f"--{s}.applies_to=all" for s in STAGES] +
                         ["--extract.favor_precision=false"])
    stages = {stage.name: stage for stage in Pipeline(config).stages}
    results = {}
    current = copy.deepcopy(docs)
    for name in STAGES:
        batch = current if name in ("extract", "normalize") else copy.deepcopy(current)
        start = time.perf_counter()
        kept = [d for d in batch if not stages[name].applies(d) or stages[name](d).kept]
        results[name] = (len(batch), len(kept), time.perf_counter() - start)
        if name in ("extract", "normalize"):
            current = kept
    return results


def datatrove_stages(docs: list[Document]) -> dict[str, tuple[int, int, float]] | None:
    try:
        from datatrove.data import Document as DTDocument
        from datatrove.pipeline.extractors import Trafilatura
        from datatrove.pipeline.filters import (
            C4QualityFilter,
            FineWebQualityFilter,
            GopherQualityFilter,
            GopherRepetitionFilter,
        )
        from datatrove.pipeline.formatters import FTFYFormatter, PIIFormatter
    except ImportError:
        return None
    steps = {"extract": Trafilatura(favour_precision=False, deduplicate=False, timeout=10,
                                    include_tables=True),
             "normalize": FTFYFormatter(), "gopher_repetition": GopherRepetitionFilter(),
             "gopher_quality": GopherQualityFilter(), "c4": C4QualityFilter(),
             "fineweb": FineWebQualityFilter(), "pii": PIIFormatter()}
    html = [DTDocument(text=d.html, id=d.id) for d in docs if d.html is not None]
    text = [DTDocument(text=d.text, id=d.id) for d in docs if d.html is None]
    start = time.perf_counter()
    current = list(steps["extract"](iter(html))) + text
    results = {"extract": (len(docs), len(current), time.perf_counter() - start)}
    for name in STAGES[1:]:
        batch = current if name == "normalize" else copy.deepcopy(current)
        start = time.perf_counter()
        out = list(steps[name](iter(batch)))
        results[name] = (len(batch), len(out), time.perf_counter() - start)
        if name == "normalize":
            current = out
    return results


def full_clean(num_proc: int) -> tuple[dict, float, str]:
    from lathe.data.runner import clean

    out = tempfile.mkdtemp(prefix="lathe-bench-")
    config = load_config(CleanConfig, ROOT / "recipes/data/stdlib.yaml", [f"--num_proc={num_proc}"])
    result = clean("stdlib", Path(out) / "clean", config, progress=False)
    return result.stats, result.seconds, out


MINHASH_CHILD = """
import random, sys, time
from lathe.data.dedup import DedupConfig, MinHasher, near_duplicate_mask
n = int(sys.argv[1]); rng = random.Random(0)
vocab = [f"w{i}" for i in range(50_000)]
def docs():
    base = None
    for i in range(n):
        if i % 10 == 9:   # every tenth document is a near copy of the one before
            words = base.split(); words[rng.randrange(len(words))] = "changed"
            yield " ".join(words)
        else:
            base = " ".join(rng.choices(vocab, k=rng.randint(40, 160))); yield base
def status_kb(field):  # ru_maxrss would include the parent's image from before exec
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
before = status_kb("VmRSS")  # what is resident now, not the import-time peak
start = time.perf_counter()
keys = MinHasher(DedupConfig()).band_keys(docs())
keep = near_duplicate_mask(keys)
after = status_kb("VmHWM")
print(n, int(keep.sum()), (after - before) / 1024, time.perf_counter() - start)
"""


def minhash_memory(n: int) -> tuple[int, float, float]:
    out = subprocess.run([sys.executable, "-c", MINHASH_CHILD, str(n)], check=True,
                         capture_output=True, text=True).stdout.split()
    return int(out[1]), float(out[2]), float(out[3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lathe.data.bench")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--minhash-docs", default="100000,1000000")
    parser.add_argument("--vocab-sizes", default="1024,4096,16384")
    add_history_arguments(parser)
    args = parser.parse_args(argv)
    cpu = platform.processor() or platform.machine()
    lines = [f"## Data stage — {datetime.date.today()} — {cpu}, {os.cpu_count()} cores, "
             f"Python {platform.python_version()}",
             "", "Command: `python -m lathe.data.bench`", ""]

    def emit(text: str = "") -> None:
        print(text)
        lines.append(text)

    docs = corpus()
    n_html = sum(d.html is not None for d in docs)
    emit(f"### Per stage, one core: stdlib corpus, {len(docs)} documents "
         f"({n_html} pydoc HTML pages, {len(docs) - n_html} .py files)")
    emit("Both run the web-recipe steps on every document, code included (no language id: "
         "datatrove's needs a downloaded fastText model). Extraction and ftfy run in a chain; "
         "each filter then sees all of their output. Whole pipeline = documents / total "
         "seconds of all stages. Kept counts differ where the word splitters differ (regex "
         "here, spaCy in datatrove).")
    emit()
    ours, theirs = lathe_stages(docs), datatrove_stages(docs)
    emit("| stage | lathe docs/s | lathe kept | datatrove docs/s | datatrove kept |")
    emit("|---|---:|---:|---:|---:|")
    totals = {"lathe": 0.0, "datatrove": 0.0}
    for name in STAGES:
        n_in, kept, sec = ours[name]
        totals["lathe"] += sec
        row = f"| {name} | {n_in / sec:,.0f} | {kept:,} |"
        if theirs:
            t_in, t_kept, t_sec = theirs[name]
            totals["datatrove"] += t_sec
            row += f" {t_in / t_sec:,.0f} | {t_kept:,} |"
        else:
            row += " – | – |"
        emit(row)
    whole = f"| **whole pipeline** | **{len(docs) / totals['lathe']:,.1f}** | |"
    whole += f" **{len(docs) / totals['datatrove']:,.1f}** | |" if theirs else " – | |"
    emit(whole)
    emit()

    stats, seconds, out = full_clean(args.num_proc)
    n_in = stats["read"].docs_in
    emit(f"### `lathe clean --recipe recipes/data/stdlib.yaml --input stdlib`, "
         f"num_proc={args.num_proc}, dedup included")
    emit(f"{n_in:,} records → {list(stats.values())[-1].kept:,} documents in {seconds:.1f}s "
         f"= {n_in / seconds:,.1f} docs/s")
    emit()

    emit("### MinHash LSH (5-gram shingles, 14 bands × 8 rows), synthetic 40–160-word docs")
    emit("| documents | kept | peak RSS over baseline (MB) | MB per 100k docs | seconds |")
    emit("|---:|---:|---:|---:|---:|")
    for n in [int(x) for x in args.minhash_docs.split(",") if x]:
        kept, mb, sec = minhash_memory(n)
        emit(f"| {n:,} | {kept:,} | {mb:,.0f} | {mb / (n / 100_000):,.1f} | {sec:,.1f} |")
    emit()

    from lathe.data.shards import build_shards
    from lathe.data.tokenizer import train_from_folder

    emit("### BPE training on the cleaned corpus (5% of documents held out)")
    emit("| vocab size | train seconds | held-out bytes/token |")
    emit("|---:|---:|---:|")
    tok_dir = None
    for size in [int(x) for x in args.vocab_sizes.split(",")]:
        tok_dir = Path(out) / f"tok-{size}"
        report = train_from_folder(Path(out) / "clean", tok_dir, size, show_progress=False)
        emit(f"| {size:,} | {report['train_seconds']:.1f} | "
             f"{report['heldout']['bytes_per_token']:.3f} |")
    emit()
    meta = build_shards(Path(out) / "clean", tok_dir, Path(out) / "shards",
                        num_proc=args.num_proc, progress=False)
    mb = sum(s["bytes"] for s in meta["splits"].values()) / 1e6
    emit(f"### Shards: {mb:.1f} MB tokenized in {meta['seconds']:.1f}s = "
         f"{mb / meta['seconds']:.2f} MB/s (num_proc={args.num_proc}, vocab {meta['vocab_size']})")
    print(f"(peak RSS of this process: "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")
    record("\n".join(lines), history_folder(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
