"""The `lathe` console script: one table of subcommands, each owned by the package that
implements it and imported only when that subcommand runs (so `lathe --help` is instant
and no package imports another just to be listed)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from lathe.model.checkpoint import CheckpointError
from lathe.model.recipe import ConfigError

# subcommand -> ("module:function" taking argv and returning an exit code, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "clean": ("lathe.data.commands:clean_main",
              "clean raw documents (filters, PII, dedup) with a recipe"),
    "tokenizer": ("lathe.data.commands:tokenizer_main",
                  "train a byte-level BPE tokenizer with chat tokens"),
    "shards": ("lathe.data.commands:shards_main",
               "tokenize cleaned documents into binary token shards"),
    "pretrain": ("lathe.pretrain.train:main",
                 "pretrain on token shards (accelerate: DDP, FSDP2, DeepSpeed; resumable)"),
    "sft": ("lathe.posttrain.sft:main",
            "supervised fine-tuning on chats, assistant tokens only (± LoRA)"),
    "dpo": ("lathe.posttrain.dpo:main",
            "direct preference optimization against a cached frozen reference (± LoRA)"),
    "grpo": ("lathe.posttrain.grpo:main",
             "GRPO with verifiable rewards, rollouts from the serve engine (± LoRA)"),
    "distill": ("lathe.posttrain.distill:main",
                "distill a teacher into a student: logit KL/JSD or SFT on teacher answers"),
    "serve": ("lathe.serve.commands:serve_main",
              "serve a checkpoint behind an OpenAI-compatible API (paged KV, batching)"),
    "chat": ("lathe.serve.commands:chat_main",
             "chat in the terminal with a checkpoint or a running server"),
    "export": ("lathe.serve.commands:export_main",
               "write a quantized (int8/int4) or GGUF (f16/q8_0) variant of a checkpoint"),
    "init": ("lathe.model.commands:init_main", "write a randomly initialized checkpoint"),
    "generate": ("lathe.model.commands:generate_main",
                 "continue a prompt with a checkpoint (greedy by default)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return ("usage: lathe COMMAND [ARGS ...]\n\n"
            "raw text to a served chat model\n\ncommands:\n" + "\n".join(lines)
            + "\n\nRun `lathe COMMAND --help` for a command's options.")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lathe: unknown command {name!r}; choose one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    return run_command(name, rest)


def run_command(name: str, argv: Sequence[str]) -> int:
    """Run subcommand `name`; a bad config or checkpoint is one line on stderr and exit 2."""
    module, function = COMMANDS[name][0].split(":")
    command = getattr(importlib.import_module(module), function)
    try:
        return command(list(argv))
    except (ConfigError, CheckpointError) as e:
        print(f"lathe {name}: error: {e}", file=sys.stderr)
        return 2
