"""Token shards and the packed, resumable dataloader."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.data.document import Document
from lathe.data.loader import PackedLoader
from lathe.data.shards import (
    HEADER,
    build_shards,
    load_meta,
    read_shard,
    token_dtype,
    write_shard,
)
from lathe.data.store import write_documents
from lathe.data.tokenizer import save_tokenizer, train_tokenizer
from tests.data.corpus import prose


def test_shard_header_round_trip_and_validation(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    write_shard(tmp_path / "a.bin", tokens)
    assert (read_shard(tmp_path / "a.bin") == tokens).all()
    assert (tmp_path / "a.bin").stat().st_size == HEADER.size + 2000
    big = np.array([0, 70_000], np.uint32)
    write_shard(tmp_path / "b.bin", big)
    assert read_shard(tmp_path / "b.bin").dtype == np.uint32
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
    (tmp_path / "c.bin").write_bytes((tmp_path / "a.bin").read_bytes()[:-2])
    with pytest.raises(ConfigError, match="truncated"):
        read_shard(tmp_path / "c.bin")
    (tmp_path / "d.bin").write_bytes(b"x" * 64)
    with pytest.raises(ConfigError, match="not a version-1 lathe token shard"):
        read_shard(tmp_path / "d.bin")


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    texts = [prose(i, paragraphs=2) for i in range(120)]
    for part in range(3):
        write_documents(root / "clean" / f"part-{part:05d}.parquet",
                        [Document(f"{part}-{i}", t) for i, t in enumerate(texts[part::3])],
                        "parquet")
    tokenizer = train_tokenizer(texts, vocab_size=400, show_progress=False)
    save_tokenizer(tokenizer, root / "tok")
    build_shards(root / "clean", root / "tok", root / "out", val_fraction=0.1, num_proc=2,
                 progress=False)
    return root, tokenizer


def test_a_worker_that_never_starts_fails_the_build_instead_of_hanging_it(shard_dir, tmp_path):
    """A script without the `__main__` guard: each spawned worker imports it and dies
    starting its own pool. The build raises, naming the guard, where a multiprocessing.Pool
    starts workers forever."""
    root, _ = shard_dir
    script = tmp_path / "unguarded.py"
    script.write_text("from lathe.data.shards import build_shards\n"
                      f"build_shards({str(root / 'clean')!r}, {str(root / 'tok')!r}, "
                      f"{str(tmp_path / 'out')!r}, num_proc=2, progress=False)\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode != 0
    assert "lacks `if __name__ == \"__main__\":`" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "out" / "meta.json").exists()


def test_shards_hold_every_document_with_separators(shard_dir):
    root, tokenizer = shard_dir
    meta = load_meta(root / "out")
    assert meta["dtype"] == "uint16" and meta["bos_token_id"] == 0
    splits = meta["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == 120
    assert splits["val"]["documents"] > 0
    tokens = np.concatenate([read_shard(root / "out" / f) for f in splits["train"]["files"]])
    assert len(tokens) == splits["train"]["tokens"]
    assert (tokens == 0).sum() == splits["train"]["documents"]
    docs = np.split(tokens, np.flatnonzero(tokens == 0))[1:]
    assert tokenizer.decode(docs[0][1:].tolist()).startswith("The ")


def test_loader_batches_are_shifted_windows_of_the_stream(shard_dir):
    root, _ = shard_dir
    loader = PackedLoader(root / "out", "train", batch_size=4, seq_len=32, seed=0)
    batch = loader.next_batch()
    assert batch.shape == (4, 33) and batch.dtype == torch.int64
    meta = load_meta(root / "out")
    stream = np.concatenate([read_shard(root / "out" / f)
                             for f in meta["splits"]["train"]["files"]]).astype(np.int64)
    index = int(loader._epoch_order()[0])
    assert (batch[0].numpy() == stream[index * 32:index * 32 + 33]).all()


def test_loader_is_deterministic_and_ranks_are_disjoint(shard_dir):
    root, _ = shard_dir

    def windows(rank, seed=0):
        loader = PackedLoader(root / "out", "train", 2, 16, seed=seed, rank=rank, world_size=2)
        return [tuple(row.tolist()) for _ in range(5) for row in loader.next_batch()]

    assert windows(0) == windows(0)
    assert windows(0) != windows(0, seed=1)
    assert not set(windows(0)) & set(windows(1))


def test_resumed_loader_yields_the_identical_next_batch(shard_dir):
    root, _ = shard_dir
    loader = PackedLoader(root / "out", "train", 3, 16, seed=7)
    steps = loader.steps_per_epoch + 2  # cross an epoch boundary
    for _ in range(steps - 1):
        loader.next_batch()
    state = loader.state_dict()
    expected = [loader.next_batch() for _ in range(3)]
    resumed = PackedLoader(root / "out", "train", 3, 16, seed=7)
    resumed.load_state_dict(state)
    for want in expected:
        assert torch.equal(resumed.next_batch(), want)
    other = PackedLoader(root / "out", "train", 2, 16, seed=7)
    with pytest.raises(ConfigError, match="batch_size"):
        other.load_state_dict(state)


def test_loader_rejects_too_little_data(shard_dir):
    root, _ = shard_dir
    with pytest.raises(ConfigError, match="fewer than one step"):
        PackedLoader(root / "out", "val", batch_size=512, seq_len=1024)


def test_plain_jsonl_with_only_a_text_field_trains_and_shards(tmp_path):
    from lathe.data.tokenizer import train_from_folder

    texts = [prose(i, paragraphs=2) for i in range(60)]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.jsonl").write_text(lines[:len(lines) // 2].rsplit("\n", 1)[0]
                                                + "\n")
    with gzip.open(tmp_path / "plain" / "b.jsonl.gz", "wt") as f:
        f.write(lines)
    train_from_folder(tmp_path / "plain", tmp_path / "tok", 400, 3, 0.1)
    meta = build_shards(tmp_path / "plain" / "b.jsonl.gz", tmp_path / "tok", tmp_path / "out",
                        val_fraction=0.1, num_proc=1, progress=False)
    splits = meta["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == 60

    (tmp_path / "wrong.jsonl").write_text('{"body": "no text here"}\n')
    with pytest.raises(ConfigError, match=r"wrong.jsonl:1: expected an object with a string "
                                          r"`text` field \(one JSON object per line"):
        build_shards(tmp_path / "wrong.jsonl", tmp_path / "tok", tmp_path / "out2",
                     num_proc=1, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a `lathe clean` output folder nor a "
                                          ".jsonl/.jsonl.gz/.parquet file"):
        train_from_folder(tmp_path / "empty", tmp_path / "tok2", 400, 3, 0.1)
