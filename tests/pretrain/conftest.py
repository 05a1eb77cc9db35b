"""A small corpus of token shards and a run-config builder shared by the pretraining tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lathe.core.config import from_dict
from lathe.data.document import Document
from lathe.data.shards import build_shards
from lathe.data.store import write_documents
from lathe.data.tokenizer import save_tokenizer, train_tokenizer
from lathe.pretrain.config import PretrainConfig
from tests.data.corpus import prose


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """Shards and tokenizer of ~300 seeded prose documents (train and val splits)."""
    root = tmp_path_factory.mktemp("pretrain-corpus")
    texts = [prose(i, paragraphs=3) for i in range(300)]
    for part in range(2):
        write_documents(root / "clean" / f"part-{part:05d}.parquet",
                        [Document(f"{part}-{i}", t) for i, t in enumerate(texts[part::2])],
                        "parquet")
    save_tokenizer(train_tokenizer(texts, vocab_size=512, show_progress=False), root / "tok")
    build_shards(root / "clean", root / "tok", root / "shards", val_fraction=0.1, num_proc=1,
                 progress=False)
    return root


def run_config(corpus: Path, out_dir: Path, **overrides) -> dict:
    """Plain-data config of a ~0.1M-parameter run on `corpus` (fast on one CPU core)."""
    config = {
        "out_dir": str(out_dir), "seed": 0, "micro_batch_size": 8, "max_steps": 12,
        "optim": {"lr": 1e-2},
        "schedule": {"warmup_steps": 2},
        "checkpoint": {"every": 4, "keep_last": 2},
        "eval": {"every": 6, "batches": 2, "sample_prompts": ["The "], "sample_tokens": 4},
        "logging": {"report_to": "none", "progress": False},
        "model": {"preset": "tiny", "overrides": {"dim": 64, "n_layers": 2, "n_heads": 4,
                                                   "n_kv_heads": 2, "max_seq_len": 64}},
        "data": {"shards": str(corpus / "shards"), "tokenizer": str(corpus / "tok"),
                 "seq_len": 32},
    }
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config


def build(config: dict) -> PretrainConfig:
    return from_dict(PretrainConfig, config)


def step_losses(out_dir: Path, name: str = "loss") -> dict[int, float]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[name] for r in records if name in r}
