"""`lathe serve` (the OpenAI-compatible server), `lathe chat` (a terminal chat against a
checkpoint or a server) and `lathe export` (quantized and GGUF variants of a checkpoint)."""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Sequence
from pathlib import Path

from lathe.core.checkpoint_files import read_config_json
from lathe.core.config import add_config_flags, config_from_flags
from lathe.core.errors import ConfigError
from lathe.data.chat_template import read_template_file
from lathe.serve.config import QuantMode, ServerConfig, WeightDtype, cache_root
from lathe.serve.core_messages import END_WITH, end_with


def serve_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lathe serve", description="Serve a checkpoint behind an OpenAI-compatible API. "
        "Every flag is a field of ServerConfig (lathe.serve.config), which --config's YAML "
        "file may set too.")
    add_config_flags(parser, ServerConfig)
    args = parser.parse_args(argv)
    if END_WITH in os.environ:  # started by a trainer (serve.remote.LocalServer): end with it
        end_with(int(os.environ[END_WITH]))
    config = config_from_flags(ServerConfig, args)
    if config.chat_template is not None:
        read_template_file(config.chat_template)
    # fail before binding a port on a wrong path; the engine core checks the rest as it loads
    # (this process, the server's front end, imports no torch)
    read_config_json(config.checkpoint)
    speculative = config.engine.speculative
    if speculative is not None and speculative.draft is not None:
        read_config_json(speculative.draft)
    # inductor's compiled code beside lathe's cached graphs, which name it: a cache in /tmp
    # (inductor's default) would not outlive a reboot
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    from lathe.serve.server import run
    run(config)
    return 0


def chat_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lathe chat", description="Chat in the terminal with a checkpoint folder or a "
                                       "running `lathe serve` (http://HOST:PORT).")
    parser.add_argument("target", help="checkpoint folder or server URL")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--prompt", help="send this one message, print the answer and exit")
    recommended = "%s (default: the model's recommended, from its generation_config.json; " \
        "else %s)"
    parser.add_argument("--temperature", type=float,
                        help=recommended % ("sampling temperature, 0: greedy", "1"))
    parser.add_argument("--top-p", type=float,
                        help=recommended % ("nucleus sampling's mass", "1: off"))
    parser.add_argument("--top-k", type=int,
                        help=recommended % ("the most likely tokens drawn from", "0: off"))
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--api-key", default=os.environ.get("LATHE_API_KEY"))
    parser.add_argument("--model", help="model id on the server (default: its first)")
    parser.add_argument("--quantize", choices=typing.get_args(QuantMode),
                        help="local checkpoints only")
    parser.add_argument("--dtype", choices=typing.get_args(WeightDtype), default="auto",
                        help="local checkpoints: the weights' dtype (auto: the checkpoint's); "
                             "see `lathe serve --help`")
    parser.add_argument("--chat-template", type=Path, metavar="FILE",
                        help="local checkpoints: a Jinja chat template used in place of "
                             "the checkpoint's")
    parser.add_argument("--tools", type=Path, metavar="FILE",
                        help="servers: a JSON list of OpenAI tool definitions to offer the "
                             "model; its calls are shown, not run")
    parser.add_argument("--tool", action="append", default=[], metavar="NAME",
                        help="servers: a tool to offer the model and run when it calls it, "
                             "in a bounded child process (calculator, or "
                             "package.module:function); repeatable")
    args = parser.parse_args(argv)
    from lathe.model.checkpoint import read_model_config
    from lathe.serve.quant import WEIGHT_DTYPES
    tools = _read_tools(args.tools) if args.tools is not None else None
    from lathe.data.tool_runner import ToolRunner
    from lathe.data.tools import load_tools
    from lathe.serve.chat import LocalChat, RemoteChat, chat_loop, say, write_stdout
    from lathe.serve.sampling_params import SamplingError, SamplingParams

    runner = ToolRunner(load_tools(args.tool)) if args.tool else None
    if runner is not None:
        tools = (tools or []) + runner.definitions()

    # what is not given stays unset: the server's (or the local checkpoint's) defaults
    sampling = {name: value for name, value in (
        ("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k),
        ("max_tokens", args.max_tokens), ("seed", args.seed)) if value is not None}
    try:
        SamplingParams(**sampling)
    except SamplingError as error:
        raise ConfigError(str(error).replace("_", "-", 1)) from None
    if args.target.startswith(("http://", "https://")):
        if args.chat_template is not None or args.quantize is not None or args.dtype != "auto":
            raise ConfigError("--chat-template, --quantize and --dtype are for a local "
                              "checkpoint; a server renders with its own (lathe serve "
                              "--chat-template) and holds its own weights")
        backend = RemoteChat(args.target, args.api_key, args.model, tools)
    else:
        if tools is not None:
            raise ConfigError("--tools and --tool are for a server (lathe serve "
                              "--tool-call-parser ...); a local checkpoint chats without tools")
        read_model_config(args.target)
        backend = LocalChat(Path(args.target), args.quantize, args.chat_template,
                            WEIGHT_DTYPES[args.dtype])
    if args.prompt is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        say(backend, messages, sampling, write_stdout, runner)
        print()
        return 0
    chat_loop(backend, sampling, args.system, tools=runner)
    return 0


def _read_tools(path: Path) -> list[dict]:
    """A --tools file: OpenAI tool definitions, checked as a server would check them."""
    import json

    from lathe.data.messages import MessageError, normalize_tools
    try:
        tools = normalize_tools(json.loads(path.read_text(encoding="utf-8")), "tools")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, MessageError) as error:
        raise ConfigError(f"--tools {path}: {error}; give a JSON list of "
                          '{"type": "function", "function": {"name", "parameters"}}') from None
    return tools or []


def export_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lathe export", description="Write a servable variant of a checkpoint: a "
        "quantized checkpoint folder (compressed-tensors: lathe, vLLM and "
        "transformers load it) or one GGUF file "
        "(llama.cpp, Ollama).")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--format", default="hf", choices=["hf", "quantized", "gguf"],
                        help="hf: a plain checkpoint folder (with --merge-lora)")
    parser.add_argument("--merge-lora", type=Path, metavar="ADAPTER",
                        help="fold this peft adapter folder into the weights first")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--quantize", choices=typing.get_args(QuantMode), default="int8",
                        help="--format quantized: the scheme (int8 / int4 weight-only, fp8 "
                        "W8A8)")
    parser.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128],
                        help="--format quantized, int4: input columns per scale")
    parser.add_argument("--dtype", choices=["f32", "f16", "bf16", "q8_0"], default="f16",
                        help="--format gguf: tensor type of the weight matrices")
    parser.add_argument("--eval-text", type=Path,
                        help="--format quantized: report perplexity on this text file "
                             "before and after quantization")
    args = parser.parse_args(argv)
    from lathe.model.checkpoint import load_checkpoint, read_model_config
    read_model_config(args.checkpoint)
    if args.format == "hf" and args.merge_lora is None:
        raise ConfigError("--format hf only makes sense with --merge-lora ADAPTER; for a "
                          "quantized or GGUF variant pass --format quantized|gguf")
    if args.merge_lora is not None:
        import tempfile

        from lathe.model.checkpoint import save_checkpoint
        from lathe.model.lora import load_adapter, merge_lora
        merged = merge_lora(load_adapter(load_checkpoint(args.checkpoint), args.merge_lora))
        target = args.out if args.format == "hf" else Path(tempfile.mkdtemp()) / "merged"
        tokenizer = args.checkpoint if (args.checkpoint / "tokenizer.json").is_file() else None
        save_checkpoint(merged, target, tokenizer=tokenizer,
                        provenance={"stage": "merge-lora", "base": str(args.checkpoint),
                                    "adapter": str(args.merge_lora)})
        print(f"merged {args.merge_lora} into {args.checkpoint} -> {target}")
        if args.format == "hf":
            return 0
        args.checkpoint = target
    from lathe.serve.quant import (
        load_serving_model,
        perplexity,
        save_quantized_checkpoint,
        weight_bytes,
    )

    if args.format == "gguf":
        from lathe.serve.gguf_export import export_gguf
        out = export_gguf(args.checkpoint, args.out, args.dtype)
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {args.dtype})")
        return 0
    save_quantized_checkpoint(args.checkpoint, args.out, args.quantize, args.group_size)
    full, quantized = load_checkpoint(args.checkpoint), load_serving_model(args.out)
    before, after = weight_bytes(full), weight_bytes(quantized)
    print(f"wrote {args.out}: weights {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB "
          f"({1 - after / before:.0%} smaller, {args.quantize})")
    if args.eval_text is not None:
        from lathe.data.tokenizer import load_tokenizer
        ids = load_tokenizer(args.checkpoint).encode(args.eval_text.read_text()).ids
        base, new = perplexity(full, ids), perplexity(quantized, ids)
        print(f"perplexity on {args.eval_text} ({len(ids)} tokens): {base:.3f} -> {new:.3f} "
              f"({new / base - 1:+.2%})")
    return 0
