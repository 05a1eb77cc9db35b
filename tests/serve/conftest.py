"""A seeded tiny checkpoint with lathe's trained BPE tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lathe.data.tokenizer import save_tokenizer, train_tokenizer
from lathe.model import ModelConfig, Transformer, save_checkpoint
from tests.data.corpus import prose


def serve_model(vocab_size: int = 512, **overrides) -> Transformer:
    """Two tiny layers with a larger init so that greedy argmaxes are not near-ties."""
    config = ModelConfig.from_preset("tiny", **{"vocab_size": vocab_size, "n_layers": 2,
                                                "init_std": 0.08, **overrides})
    torch.manual_seed(0)
    return Transformer(config).eval()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    tokenizer = train_tokenizer([prose(i, paragraphs=2) for i in range(60)], vocab_size=512,
                                show_progress=False)
    save_tokenizer(tokenizer, root / "tokenizer")
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return save_checkpoint(serve_model(vocab), root / "ckpt", tokenizer=root / "tokenizer")
