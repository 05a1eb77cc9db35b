"""Cleaned-document shards on disk: Parquet (id, text, kind, metadata as JSON) or JSONL
with the same fields, written atomically, and read back in file order by the tokenizer
trainer, the shard writer and the dedup phase."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from lathe.data.document import Document
from lathe.model.atomic import atomic_file
from lathe.model.recipe import ConfigError

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
    for row in _rows(Path(path)):
        yield Document(row["id"], row["text"], kind=row["kind"],
                       metadata=json.loads(row["metadata"]))


def _rows(path: Path) -> Iterator[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    else:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def document_files(folder: str | Path) -> list[Path]:
    """The cleaned shards of a `lathe clean` output folder, in order."""
    folder = Path(folder)
    files = sorted(p for p in folder.glob("part-*") if p.suffix in (".parquet", ".jsonl"))
    if not files:
        raise ConfigError(f"--input {str(folder)!r} has no part-*.parquet or part-*.jsonl "
                          "files; point it at the output of `lathe clean`")
    return files


def iter_texts(folder: str | Path) -> Iterator[str]:
    for path in document_files(folder):
        for doc in read_documents(path):
            yield doc.text
