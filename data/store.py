"""Cleaned-document shards on disk: Parquet (id, text, kind, metadata as JSON) or JSONL
with the same fields, written atomically, and read back in file order by the tokenizer
trainer, the shard writer and the dedup phase."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from lathe.core.atomic import atomic_file
from lathe.core.errors import ConfigError
from lathe.data.document import Document

Format = Literal["parquet", "jsonl"]
SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl"}


def write_documents(path: str | Path, docs: Sequence[Document], fmt: Format) -> None:
    rows = [{"id": d.id, "text": d.text, "kind": d.kind,
             "metadata": json.dumps(d.metadata, sort_keys=True)} for d in docs]
    with atomic_file(path) as tmp:
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            schema = pa.schema([("id", pa.string()), ("text", pa.string()),
                                ("kind", pa.string()), ("metadata", pa.string())])
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp, compression="zstd")
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_documents(path: str | Path) -> Iterator[Document]:
    """The documents of one file: a `lathe clean` shard, or any JSONL (optionally .gz) or
    Parquet file whose rows have a string `text` (`id`, `kind` and `metadata` optional)."""
    path = Path(path)
    for number, row in enumerate(_rows(path), 1):
        where = f"{path}:{number}"
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ConfigError(f"{where}: expected an object with a string `text` field ("
                              f"{LAYOUT}); got {str(row)[:80]!r}")
        metadata = row.get("metadata") or {}
        if isinstance(metadata, str):
            metadata = json.loads(metadata)
        yield Document(str(row.get("id") or where), row["text"],
                       kind=row.get("kind") or "prose", metadata=metadata)


LAYOUT = ("one JSON object per line, or Parquet rows, with a string `text`; `id`, `kind` "
          "(prose|code) and `metadata` are optional")


def _rows(path: Path) -> Iterator[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path}:{number}: not JSON ({error}); expected "
                                  f"{LAYOUT}") from None


def document_files(source: str | Path) -> list[Path]:
    """The files of a document input, in order: the `part-*` shards of a `lathe clean`
    output folder, else a folder's .jsonl, .jsonl.gz and .parquet files, or one file."""
    source = Path(source)
    if source.is_file():
        return [source]
    files = sorted(p for p in source.glob("part-*") if p.suffix in (".parquet", ".jsonl"))
    if not files:
        files = sorted(p for p in source.glob("*") if p.is_file() and p.name.endswith(
            (".jsonl", ".jsonl.gz", ".parquet")))
    if not files:
        raise ConfigError(f"--input {str(source)!r} is not a `lathe clean` output folder "
                          "nor a .jsonl/.jsonl.gz/.parquet file or a folder of them; give "
                          f"one of those ({LAYOUT})")
    return files


def iter_texts(folder: str | Path) -> Iterator[str]:
    for path in document_files(folder):
        for doc in read_documents(path):
            yield doc.text
