"""`lathe clean`, `lathe tokenizer train` and `lathe shards`: argument parsing, the run,
and the summary a person reads at the end."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from lathe.core.errors import ConfigError

INPUT_HELP = ("a `lathe clean` output folder, or a .jsonl[.gz]/.parquet file (or a folder of "
              "them) whose records have a string `text`")


def clean_main(argv: Sequence[str] | None = None) -> int:
    from lathe.core.config import load_config
    from lathe.data.pipeline import CleanConfig
    from lathe.data.runner import clean
    from lathe.data.stats import format_table

    parser = argparse.ArgumentParser(
        prog="lathe clean",
        description="Clean raw documents: extraction, normalization, language id, quality "
                    "and repetition filters, PII scrubbing, exact and near dedup. Any recipe "
                    "field can be overridden, e.g. --gopher_quality.min_words=100.")
    parser.add_argument("--recipe", required=True, type=Path,
                        help="YAML recipe, e.g. recipes/data/web.yaml")
    parser.add_argument("--input", required=True,
                        help="`stdlib`, `hf:NAME`, a saved HF dataset, a file or a folder")
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--executor", choices=["local", "ray"], default="local",
                        help="local: worker processes here; ray: Ray Data tasks on a Ray "
                             "cluster (pip install -e '.[distributed]')")
    parser.add_argument("--address", help="Ray cluster to join (e.g. auto or "
                                          "ray://HEAD:10001); default: start Ray here")
    args, rest = parser.parse_known_args(argv)
    config = load_config(CleanConfig, args.recipe, rest)
    executor = None
    if args.executor == "ray":
        from lathe.data.ray_executor import RayExecutor
        executor = RayExecutor(args.address, num_cpus=config.num_proc)
    elif args.address:
        raise ConfigError("--address joins a Ray cluster; it needs --executor ray")
    result = clean(args.input, args.output, config, progress=not args.no_progress,
                   executor=executor)
    print(format_table(result.stats))
    print(f"wrote {args.output} in {result.seconds:.1f}s (stats in {args.output}/stats.json)")
    return 0


def tokenizer_main(argv: Sequence[str] | None = None) -> int:
    from lathe.data.tokenizer import train_from_folder

    parser = argparse.ArgumentParser(
        prog="lathe tokenizer", description="Train a byte-level BPE tokenizer.")
    sub = parser.add_subparsers(dest="action", required=True)
    train = sub.add_parser("train", help="train on the output of `lathe clean`")
    train.add_argument("--input", required=True, type=Path, help=INPUT_HELP)
    train.add_argument("--vocab-size", required=True, type=int)
    train.add_argument("--output", required=True, type=Path)
    train.add_argument("--max-digits", type=int, default=3,
                       help="numbers are split into groups of at most this many digits")
    train.add_argument("--heldout-fraction", type=float, default=0.05,
                       help="documents held out for the compression report")
    args = parser.parse_args(argv)
    report = train_from_folder(args.input, args.output, args.vocab_size, args.max_digits,
                               args.heldout_fraction)
    held = report["heldout"]
    print(f"trained vocab {report['vocab_size']:,} in {report['train_seconds']:.1f}s; held-out "
          f"{held['bytes']:,} bytes → {held['tokens']:,} tokens = "
          f"{held['bytes_per_token']:.3f} bytes/token; wrote {args.output}")
    return 0


def shards_main(argv: Sequence[str] | None = None) -> int:
    from lathe.data.shards import build_shards

    parser = argparse.ArgumentParser(
        prog="lathe shards", description="Tokenize cleaned documents into binary shards.")
    parser.add_argument("--input", required=True, type=Path, help=INPUT_HELP)
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.num_proc < 1:
        raise ConfigError(f"--num-proc={args.num_proc} must be at least 1")
    meta = build_shards(args.input, args.tokenizer, args.output, args.val_fraction,
                        args.num_proc, progress=not args.no_progress)
    splits = meta["splits"]
    mb = (splits["train"]["bytes"] + splits["val"]["bytes"]) / 1e6
    print(json.dumps({k: {f: v for f, v in s.items() if f != "files"}
                      for k, s in splits.items()}))
    print(f"{mb:.1f} MB tokenized in {meta['seconds']:.1f}s ({mb / meta['seconds']:.2f} MB/s), "
          f"{meta['dtype']} shards in {args.output}")
    return 0
