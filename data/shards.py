"""Token shards (`lathe shards`): cleaned documents tokenized in parallel into flat binary
files that pretraining memory-maps.

A shard is a 32-byte header — magic `LATHETOK`, format version, bytes per token (2 while
the vocabulary fits uint16, else 4), token count — followed by the tokens. Every document
starts with `<|begin_of_text|>`, the separator. Each cleaned part becomes one `train-*`
and one `val-*` shard (documents are split by the same content hash the tokenizer report
uses); `meta.json`, written last, lists them and marks the folder complete.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import struct
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lathe.core.atomic import atomic_file, write_json
from lathe.core.errors import ConfigError
from lathe.core.reporting import progress_bar
from lathe.data.chat import BOS
from lathe.data.store import document_files, read_documents
from lathe.data.tokenizer import is_heldout

MAGIC = b"LATHETOK"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, itemsize, n_tokens, reserved
META_FILE = "meta.json"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65_536 else np.uint32)


def write_shard(path: str | Path, tokens: np.ndarray) -> None:
    if tokens.dtype not in (np.uint16, np.uint32):
        raise ValueError(f"shard tokens must be uint16 or uint32, got {tokens.dtype}")
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, tokens.itemsize, len(tokens), 0))
        f.write(np.ascontiguousarray(tokens).tobytes())


def read_shard(path: str | Path) -> np.ndarray:
    """Memory-map a shard's tokens, checking the header against the file size."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise ConfigError(f"{path} is not a lathe token shard (shorter than its header)")
    magic, version, itemsize, n_tokens, _ = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or itemsize not in (2, 4):
        raise ConfigError(f"{path} is not a version-{VERSION} lathe token shard "
                          f"(magic {magic!r}, version {version}); rebuild with `lathe shards`")
    expected = HEADER.size + n_tokens * itemsize
    if path.stat().st_size != expected:
        raise ConfigError(f"{path} is truncated: header says {n_tokens} tokens "
                          f"({expected} bytes), file has {path.stat().st_size}")
    if n_tokens == 0:
        return np.zeros(0, np.uint16 if itemsize == 2 else np.uint32)
    return np.memmap(path, dtype=np.uint16 if itemsize == 2 else np.uint32, mode="r",
                     offset=HEADER.size, shape=(n_tokens,))


@dataclass
class _Job:
    part: str
    tokenizer_file: str
    output: str
    index: int
    val_fraction: float


def _tokenize_part(job: _Job) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(job.tokenizer_file)
    bos = tokenizer.token_to_id(BOS)
    dtype = token_dtype(tokenizer.get_vocab_size())
    texts: dict[str, list[str]] = {split: [] for split in SPLITS}
    for doc in read_documents(job.part):
        texts["val" if is_heldout(doc.text, job.val_fraction) else "train"].append(doc.text)
    result: dict[str, Any] = {"part": Path(job.part).name}
    for split in SPLITS:
        encoded = tokenizer.encode_batch(texts[split], add_special_tokens=False)
        pieces = [np.array([bos] + e.ids, dtype) for e in encoded]
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
        name = f"{split}-{job.index:05d}.bin"
        write_shard(Path(job.output) / name, tokens)
        result[split] = {"file": name, "documents": len(pieces), "tokens": int(len(tokens)),
                         "bytes": sum(len(t.encode()) for t in texts[split])}
    return result


def build_shards(input_dir: str | Path, tokenizer_dir: str | Path, output: str | Path,
                 val_fraction: float = 0.05, num_proc: int = 2,
                 progress: bool = True) -> dict[str, Any]:
    """Tokenize every cleaned part into train/val shards; returns what meta.json holds."""
    output, tokenizer_file = Path(output), Path(tokenizer_dir) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(f"--tokenizer {str(tokenizer_dir)!r} has no tokenizer.json; "
                          "train one with `lathe tokenizer train`")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction={val_fraction} must be in [0, 1)")
    if (output / META_FILE).exists():
        raise ConfigError(f"--output {str(output)!r} already holds finished shards; "
                          "choose a new folder or delete it")
    parts = document_files(input_dir)
    jobs = [_Job(str(p), str(tokenizer_file), str(output), i, val_fraction)
            for i, p in enumerate(parts)]
    start = time.perf_counter()
    output.mkdir(parents=True, exist_ok=True)
    results = []
    # an executor, not multiprocessing.Pool: a worker that dies (killed, out of memory, or
    # never started) fails the build here, where Pool would start another and wait forever
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max(1, num_proc), mp_context=spawn) as pool, \
            progress_bar(total=len(jobs), unit="part", desc="shards", enabled=progress) as bar:
        try:
            for result in pool.map(_tokenize_part, jobs):
                results.append(result)
                bar.update()
        except BrokenProcessPool as error:
            main = getattr(sys.modules["__main__"], "__file__", None)
            raise RuntimeError(
                f"a tokenizing worker died ({error}): killed or out of memory, or the script "
                f"that called build_shards ({main}) lacks `if __name__ == \"__main__\":` "
                "(the workers are spawned and import it); the partial shards in "
                f"{str(output)!r} are not published") from error
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    seconds = time.perf_counter() - start
    meta = {
        "version": VERSION, "dtype": token_dtype(tokenizer.get_vocab_size()).name,
        "vocab_size": tokenizer.get_vocab_size(), "bos_token_id": tokenizer.token_to_id(BOS),
        "tokenizer_sha256": hashlib.sha256(tokenizer_file.read_bytes()).hexdigest(),
        "input": str(input_dir), "val_fraction": val_fraction, "seconds": round(seconds, 2),
        "splits": {split: {"files": [r[split]["file"] for r in results],
                           "documents": sum(r[split]["documents"] for r in results),
                           "tokens": sum(r[split]["tokens"] for r in results),
                           "bytes": sum(r[split]["bytes"] for r in results)}
                   for split in SPLITS},
    }
    write_json(output / META_FILE, meta)
    return meta


def load_meta(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise ConfigError(f"{str(folder)!r} has no {META_FILE}; it is not a finished "
                          "`lathe shards` output")
    return json.loads(path.read_text())
