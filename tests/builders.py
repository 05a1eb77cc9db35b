"""Small seeded things tests build: models and tokenizers; and a fresh accelerate state."""

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lathe.model import ModelConfig, Transformer


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state, so the next run builds its own Accelerator
    (with its own mixed precision) as a fresh process would."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def tiny_model(**overrides) -> Transformer:
    """A seeded model from the tiny preset, with overrides (fp32, eval mode)."""
    config = ModelConfig.from_preset("tiny", **{"vocab_size": 256, "max_seq_len": 128,
                                                **overrides})
    torch.manual_seed(0)
    return Transformer(config).eval()


def serve_model(vocab_size: int = 512, **overrides) -> Transformer:
    """Two tiny layers at the preset's 256 positions, with a larger init so that greedy
    argmaxes are not near-ties."""
    return tiny_model(**{"vocab_size": vocab_size, "n_layers": 2, "init_std": 0.08,
                         "max_seq_len": 256, **overrides})


def build_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    """A small byte-level BPE with chat special tokens, written as an HF tokenizer folder."""
    specials = ["<|begin_of_text|>", "<|end_of_turn|>", "<|pad|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog", "hello world", "def f(x): return x"]
    tokenizer.train_from_iterator(text * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials[0], "eos_token": specials[1], "pad_token": specials[2],
    }))
    return folder
