"""`lathe init` (a randomly initialized checkpoint, or a distillation student cut from a
teacher's layers) and `lathe generate` (continue a prompt)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer

from lathe.core.checkpoint_files import checkpoint_file, read_eos_ids
from lathe.core.config import parse_overrides
from lathe.core.errors import ConfigError
from lathe.model.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from lathe.model.config import PRESETS, ModelConfig
from lathe.model.families import FAMILIES
from lathe.model.generate import generate
from lathe.model.student import student_from_teacher
from lathe.model.transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lathe init",
        description="Write a randomly initialized model as an HF-layout checkpoint (any "
                    "ModelConfig field can be overridden, e.g. --n_layers=2), or with "
                    "--from-teacher a student made of some of a checkpoint's layers.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=list(PRESETS))
    source.add_argument("--from-teacher", type=Path, metavar="CKPT",
                        help="start from this checkpoint's embeddings, head and --keep-layers "
                             "(its tokenizer is copied)")
    parser.add_argument("--keep-layers",
                        help="--from-teacher: comma-separated decoder layers to keep "
                             "(negative counts from the end); default one in two, 0,2,4,… "
                             "(DistilBERT's rule)")
    parser.add_argument("--family", choices=list(FAMILIES), default="llama",
                        help="--preset: the open-model family to write it as (the preset's "
                             "shape with the family's switches; e.g. qwen3, gemma2, phi3)")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint folder to write")
    parser.add_argument("--tokenizer", type=Path,
                        help="tokenizer folder: sets vocab_size and is copied into the checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    args, rest = parser.parse_known_args(argv)
    if args.from_teacher is not None:
        return _init_student(args, rest)
    overrides = dict(parse_overrides(rest))
    if args.tokenizer is not None:
        tokenizer_file = args.tokenizer / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"--tokenizer {args.tokenizer}: no tokenizer.json in that folder")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        overrides["vocab_size"] = tokenizer.get_vocab_size(with_added_tokens=True)
    config = ModelConfig.from_preset(args.preset, **{"family": args.family, **overrides})
    torch.manual_seed(args.seed)
    model = Transformer(config).to(DTYPES[args.dtype])
    provenance = {"stage": "init", "preset": args.preset, "family": config.family,
                  "seed": args.seed, "overrides": overrides}
    save_checkpoint(model, args.out, tokenizer=args.tokenizer, provenance=provenance)
    print(f"wrote {args.preset} {config.family} checkpoint ({config.num_params() / 1e6:.2f}M "
          f"parameters, {args.dtype}) to {args.out}")
    return 0


def _init_student(args: argparse.Namespace, rest: list[str]) -> int:
    if rest:
        raise ConfigError(f"--from-teacher takes its shape from the teacher; drop {rest}")
    teacher = load_checkpoint(args.from_teacher)
    count = teacher.config.n_layers
    if args.keep_layers is None:
        args.keep_layers = ",".join(map(str, range(0, count, 2)))
    try:
        layers = [int(i) % count if -count <= int(i) < count else int(i)
                  for i in args.keep_layers.split(",")]
    except ValueError:
        raise ConfigError(f"--keep-layers={args.keep_layers!r} must be comma-separated layer "
                          "indices, e.g. 0,-1") from None
    student = student_from_teacher(teacher, layers).to(DTYPES[args.dtype])
    tokenizer = args.from_teacher if (args.from_teacher / "tokenizer.json").is_file() else None
    save_checkpoint(student, args.out, tokenizer=tokenizer,
                    provenance={"stage": "init", "teacher": str(args.from_teacher),
                                "layers": layers})
    print(f"wrote a {len(layers)}-layer student of {args.from_teacher} (layers {layers}, "
          f"{student.config.num_params() / 1e6:.2f}M parameters) to {args.out}")
    return 0


def generate_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lathe generate", description="Continue a prompt with a checkpoint.")
    parser.add_argument("checkpoint", type=Path)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--prompt", help="text (needs tokenizer.json in the checkpoint)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be at least 1")
    if args.temperature < 0:
        raise ConfigError(f"--temperature={args.temperature} must be >= 0 (0 means greedy)")

    start = time.perf_counter()
    model = load_checkpoint(args.checkpoint, device=args.device)
    load_seconds = time.perf_counter() - start
    tokenizer = _checkpoint_tokenizer(args.checkpoint)
    prompt_ids = _prompt_ids(args, tokenizer, model.config)
    eos = read_eos_ids(args.checkpoint, model.config.vocab_size)
    generator = torch.Generator(args.device).manual_seed(args.seed)
    start = time.perf_counter()
    new_ids = generate(
        model, torch.tensor([prompt_ids], device=args.device), args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k,
        eos_token_id=eos[0] if len(eos) == 1 else None, generator=generator,
    )[0].tolist()
    seconds = time.perf_counter() - start
    print("continuation ids:", ",".join(map(str, new_ids)))
    if tokenizer is not None:
        print("continuation text:", tokenizer.decode(new_ids))
    print(f"({len(new_ids)} tokens in {seconds:.2f}s after a {load_seconds:.2f}s load)")
    return 0


def _prompt_ids(args: argparse.Namespace, tokenizer: Tokenizer | None,
                config: ModelConfig) -> list[int]:
    if args.prompt is not None:
        if tokenizer is None:
            raise ConfigError(f"--prompt needs {args.checkpoint}/tokenizer.json; this checkpoint "
                              "has no tokenizer, so pass --prompt-ids instead")
        ids = tokenizer.encode(args.prompt).ids
    else:
        try:
            ids = [int(part) for part in args.prompt_ids.split(",")]
        except ValueError:
            raise ConfigError(f"--prompt-ids={args.prompt_ids!r} must be comma-separated "
                              "integers, e.g. 1,2,3") from None
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if not ids or bad:
        raise ConfigError(f"prompt ids {bad or ids} are not valid: give at least one id in "
                          f"[0, {config.vocab_size})")
    if len(ids) + args.max_new_tokens > config.max_seq_len:
        raise ConfigError(
            f"prompt of {len(ids)} tokens + --max-new-tokens={args.max_new_tokens} exceeds the "
            f"model's max_seq_len={config.max_seq_len}; shorten one of them"
        )
    return ids


def _checkpoint_tokenizer(path: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer.json, if it has one (a link out of the folder refused)."""
    file = checkpoint_file(path, "tokenizer.json")
    if not file.is_file():
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # the Rust loader raises a bare Exception
        raise CheckpointError(f"{file}: not a tokenizer the `tokenizers` library loads "
                              f"({error})") from None


