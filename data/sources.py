"""Sources: where raw documents come from. A source is split into `InputShard`s, each a
picklable recipe for reading one slice (a file, a group of files, a slice of a Hugging
Face dataset) so the runner can hand shards to worker processes and resume per shard.

Readers yield `Document`s, and `Rejected` records for input that is not a document:
invalid JSON, invalid UTF-8, a missing or empty text, a text over `max_doc_bytes`. A file
that breaks off (a truncated gzip, a WARC record running past the end) ends its reader
with one `Rejected` naming the file and offset; `read_guarded` turns whatever else a
reader raises into one, so a bad file never stops a run.
"""

from __future__ import annotations

import functools
import gzip
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lathe.core.errors import ConfigError
from lathe.data.document import Document, Kind, Rejected

Record = Document | Rejected


@dataclass
class SourceConfig:
    text_field: str = "text"
    html_field: str | None = None  # records with this field hold raw HTML to extract
    id_field: str = "id"
    kind: Kind = "prose"  # stdlib sets the kind per document (code for .py files)
    max_doc_bytes: int = 10_000_000
    files_per_shard: int = 200  # folders of .txt/.html files and the stdlib corpus
    split: str = "train"  # Hugging Face datasets
    hf_config: str | None = None
    streaming: bool = False
    hf_shards: int = 8  # slices of a non-streaming HF dataset handed to workers


@dataclass
class InputShard:
    name: str
    read: Callable[[], Iterator[Record]]  # a functools.partial, so it pickles


def list_shards(spec: str, config: SourceConfig) -> list[InputShard]:
    """Resolve `spec` — `stdlib`, `hf:NAME`, a file, or a folder — into shards."""
    if spec == "stdlib":
        from lathe.data.stdlib_corpus import stdlib_shards

        return stdlib_shards(config)
    if spec.startswith("hf:"):
        return _hf_shards(spec[3:], config, from_disk=False)
    path = Path(spec)
    if path.is_dir() and any((path / f).exists() for f in
                             ("dataset_info.json", "state.json", "dataset_dict.json")):
        return _hf_shards(str(path), config, from_disk=True)
    if path.is_file():
        return [_file_shard(path, path.name, config)]
    if path.is_dir():
        return _folder_shards(path, config)
    raise ConfigError(f"--input {spec!r} is neither `stdlib`, `hf:NAME`, a file nor a folder")


_FILE_READERS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".json.gz": "jsonl",
                 ".parquet": "parquet", ".warc": "warc", ".warc.gz": "warc"}
_LOOSE = {".txt": "prose", ".html": "html", ".htm": "html"}


def _suffix(path: Path) -> str:
    return "".join(path.suffixes[-2:]) if path.name.endswith(".gz") else path.suffix


def _file_shard(path: Path, name: str, config: SourceConfig) -> InputShard:
    fmt = _FILE_READERS.get(_suffix(path))
    if fmt is None:
        if path.suffix in _LOOSE:
            return InputShard(name, functools.partial(read_loose_files, [str(path)], config))
        raise ConfigError(f"input file {str(path)!r} has an unknown format; use .jsonl[.gz], "
                          ".parquet, .warc[.gz], .txt or .html")
    reader = {"jsonl": read_jsonl, "parquet": read_parquet, "warc": read_warc}[fmt]
    return InputShard(name, functools.partial(reader, str(path), config))


def _folder_shards(root: Path, config: SourceConfig) -> list[InputShard]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    shards = [_file_shard(p, str(p.relative_to(root)), config)
              for p in files if _suffix(p) in _FILE_READERS]
    loose = [str(p) for p in files if p.suffix in _LOOSE]
    for i in range(0, len(loose), config.files_per_shard):
        group = loose[i:i + config.files_per_shard]
        shards.append(InputShard(f"files-{i // config.files_per_shard:05d}",
                                 functools.partial(read_loose_files, group, config)))
    if not shards:
        raise ConfigError(f"input folder {str(root)!r} has no .jsonl[.gz], .parquet, "
                          ".warc[.gz], .txt or .html files")
    return shards


def make_document(record: dict[str, Any], where: str, config: SourceConfig) -> Record:
    """Validate one record of a table-like source and turn it into a Document: raw HTML
    from `html_field` when the record has it, else text from `text_field`."""
    field_name = config.text_field
    if config.html_field is not None and record.get(config.html_field) is not None:
        field_name = config.html_field
    value = record.get(field_name)
    if value is None:
        return Rejected(where, "missing_text")
    if not isinstance(value, str):
        return Rejected(where, "text_not_a_string")
    return text_document(value, str(record.get(config.id_field) or where), where, config,
                         is_html=field_name == config.html_field,
                         metadata={k: v for k, v in record.items()
                                   if k not in (config.text_field, config.html_field,
                                                config.id_field)
                                   and isinstance(v, str | int | float | bool)})


def text_document(value: str, doc_id: str, where: str, config: SourceConfig, *,
                  is_html: bool = False, kind: Kind | None = None,
                  metadata: dict[str, Any] | None = None) -> Record:
    if not value.strip():
        return Rejected(where, "empty_text")
    if len(value) > config.max_doc_bytes or len(value.encode("utf-8", "surrogatepass")) \
            > config.max_doc_bytes:
        return Rejected(where, "too_large")
    return Document(id=doc_id, text="" if is_html else value, html=value if is_html else None,
                    kind=kind or config.kind, metadata=metadata or {})


def read_guarded(shard: InputShard) -> Iterator[Record]:
    """The shard's records; a reader that fails ends with a `Rejected("unreadable_file")`."""
    try:
        yield from shard.read()
    except Exception as error:
        yield Rejected(shard.name, "unreadable_file", f"{type(error).__name__}: {error}")


def read_jsonl(path: str, config: SourceConfig) -> Iterator[Record]:
    try:
        yield from _jsonl_records(path, config)
    except (EOFError, OSError, zlib.error) as error:  # truncated or corrupt gzip
        yield Rejected(path, "truncated_file", f"{type(error).__name__}: {error}")


def _jsonl_records(path: str, config: SourceConfig) -> Iterator[Record]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield Rejected(where, "invalid_utf8")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                yield Rejected(where, "invalid_json")
                continue
            if not isinstance(record, dict):
                yield Rejected(where, "invalid_json")
                continue
            yield make_document(record, where, config)


def read_parquet(path: str, config: SourceConfig) -> Iterator[Record]:
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            number += 1
            yield make_document(record, f"{path}:{number}", config)


def read_utf8(path: str | Path) -> str | None:
    """The file's text, or None when it is not valid UTF-8."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_loose_files(paths: list[str], config: SourceConfig) -> Iterator[Record]:
    for path in paths:
        value = read_utf8(path)
        if value is None:
            yield Rejected(path, "invalid_utf8")
            continue
        yield text_document(value, path, path, config, is_html=Path(path).suffix != ".txt",
                            metadata={"path": path})


def read_warc(path: str, config: SourceConfig) -> Iterator[Record]:
    from warcio.archiveiterator import ArchiveIterator

    with open(path, "rb") as f:
        records = ArchiveIterator(f)
        try:
            yield from _warc_documents(path, records, config)
        except Exception as error:  # warcio raises assorted errors on a broken record
            offset = records.offset  # where the broken record starts
            yield Rejected(f"{path}@{offset}", "broken_warc_record",
                           f"{type(error).__name__}: {error}")


def _warc_documents(path: str, records: Any, config: SourceConfig) -> Iterator[Record]:
    for record in records:
        if record.rec_type != "response":
            continue
        headers = record.http_headers
        content_type = (headers.get_header("Content-Type") if headers else None) or ""
        if "html" not in content_type.lower():
            continue
        record_id = record.rec_headers.get_header("WARC-Record-ID")
        url = record.rec_headers.get_header("WARC-Target-URI")
        charset = "utf-8"
        if "charset=" in content_type:
            charset = content_type.split("charset=")[-1].split(";")[0].strip() or charset
        body = record.content_stream().read()
        try:
            html = body.decode(charset)
        except (UnicodeDecodeError, LookupError):
            yield Rejected(f"{path}:{record_id}", "invalid_encoding")
            continue
        yield text_document(html, record_id, f"{path}:{record_id}", config, is_html=True,
                            metadata={"url": url})


def _hf_shards(name: str, config: SourceConfig, *, from_disk: bool) -> list[InputShard]:
    if config.streaming and not from_disk:
        dataset = _load_hf(name, config, from_disk)
        count = max(1, dataset.num_shards)
    else:
        count = config.hf_shards
    return [InputShard(f"hf-{i:05d}-of-{count:05d}",
                       functools.partial(read_hf, name, config, from_disk, i, count))
            for i in range(count)]


def _load_hf(name: str, config: SourceConfig, from_disk: bool):
    import datasets

    if from_disk:
        dataset = datasets.load_from_disk(name)
        if isinstance(dataset, datasets.DatasetDict):
            if config.split not in dataset:
                raise ConfigError(f"source.split {config.split!r} not in {name!r}; "
                                  f"choose one of {list(dataset)}")
            dataset = dataset[config.split]
        if config.streaming:
            return dataset.to_iterable_dataset(num_shards=config.hf_shards)
        return dataset
    return datasets.load_dataset(name, config.hf_config, split=config.split,
                                 streaming=config.streaming)


def read_hf(name: str, config: SourceConfig, from_disk: bool, index: int,
            count: int) -> Iterator[Record]:
    dataset = _load_hf(name, config, from_disk)
    if config.streaming:
        if dataset.num_shards >= count:
            dataset = dataset.shard(num_shards=count, index=index)
        elif index:
            return
    else:
        dataset = dataset.shard(num_shards=count, index=index, contiguous=True)
    for number, record in enumerate(dataset, 1):
        yield make_document(record, f"{name}[{index}/{count}]:{number}", config)
