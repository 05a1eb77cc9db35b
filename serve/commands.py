"""`lathe serve` (the OpenAI-compatible server), `lathe chat` (a terminal chat against a
checkpoint or a server) and `lathe export` (quantized and GGUF variants of a checkpoint)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from lathe.core.errors import ConfigError
from lathe.data.chat_template import read_template_file
from lathe.model.checkpoint import read_model_config
from lathe.serve.connections import ConnectionLimits
from lathe.serve.decode_graph import cache_root
from lathe.serve.engine import DEFAULT_KV_MB, EngineConfig
from lathe.serve.engine_core import END_WITH, end_with
from lathe.serve.reasoning import REASONING_PARSERS
from lathe.serve.speculative import SpeculativeConfig
from lathe.serve.tool_calls import PARSERS

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
DTYPE_HELP = ("the weights' dtype (auto: the checkpoint's). On a GPU the activations' too; on "
              "the CPU activations are float32 and bfloat16/float16 keep the linears and the "
              "embedding in half precision, halving the bytes a decode step reads")


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--quantize", choices=["int8", "int4"],
                       help="weight-only quantization applied at load")
    group.add_argument("--dtype", choices=list(DTYPES), default="auto", help=DTYPE_HELP)
    group.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    group.add_argument("--max-num-batched-tokens", type=int,
                       default=EngineConfig.max_num_batched_tokens)
    group.add_argument("--max-decode-stall", type=float,
                       default=EngineConfig.max_decode_stall,
                       help="with streams decoding, a step lasts at most this many "
                            "decode-only steps: new prompts' prefill is cut into chunks that "
                            "fit, by the engine's running estimate of each step's cost. "
                            "Smoother streams, later first tokens: on an 88M model at 16 "
                            "concurrent requests, 4 cut the inter-token p99 from 312 to 144 "
                            "ms but doubled the time-to-first-token p99 and lost 27%% of "
                            "the throughput. 0 (default): off, prefills take the whole "
                            "--max-num-batched-tokens")
    group.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    group.add_argument("--kv-cache-memory-mb", type=float,
                       help="KV budget, on a GPU too (default: on a GPU, the share "
                            "--gpu-memory-utilization leaves; off it, what --max-num-seqs "
                            "sequences of the model's full length take, at most "
                            f"{DEFAULT_KV_MB} MiB)")
    group.add_argument("--gpu-memory-utilization", type=float,
                       default=EngineConfig.gpu_memory_utilization)
    group.add_argument("--enforce-eager", action="store_true",
                       help="run every step eagerly; by default decode steps (and on "
                            "CPU short prefills) run compiled, one graph per batch-size "
                            "bucket (CUDA graphs on CUDA); off CUDA they are built in the "
                            "background while the server already answers (eagerly, each "
                            "batch size switching to its graphs once built) and cached "
                            "across starts under $LATHE_CACHE_DIR (default ~/.cache/lathe); "
                            "on CUDA, before /health turns ok")
    group.add_argument("--compile-before-ready", action="store_true",
                       help="build every compiled decode step before /health turns ok "
                            "(no eager step after the start: for benchmarks)")
    group.add_argument("--decode-steps", type=int, default=EngineConfig.decode_steps,
                       help="multi-step decoding: forward passes a decode-only step runs "
                            "before scheduling and streaming again (output streams in runs "
                            "of this many tokens; not with speculative decoding)")
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--draft", type=Path, metavar="CKPT",
                       help="draft model checkpoint sharing this model's tokenizer (e.g. the "
                            "student of `lathe distill`)")
    group.add_argument("--speculative", choices=["draft", "ngram"],
                       help="draft: --draft's model proposes; ngram: prompt lookup "
                            "(default: draft when --draft is given)")
    group.add_argument("--num-speculative-tokens", type=int,
                       default=SpeculativeConfig.num_speculative_tokens,
                       help="draft tokens verified per step")
    group.add_argument("--prompt-lookup-max", type=int,
                       default=SpeculativeConfig.prompt_lookup_max,
                       help="ngram: longest suffix looked up")
    group.add_argument("--prompt-lookup-min", type=int,
                       default=SpeculativeConfig.prompt_lookup_min,
                       help="ngram: shortest suffix looked up")


def _speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    method = args.speculative or ("draft" if args.draft is not None else None)
    if method is None:
        return None
    if method == "draft" and args.draft is None:
        raise ConfigError("--speculative draft needs --draft CKPT (a draft model sharing this "
                          "model's tokenizer)")
    if method == "ngram" and args.draft is not None:
        raise ConfigError("--draft is for --speculative draft; prompt lookup (ngram) needs no "
                          "draft model — drop one of them")
    if args.draft is not None:
        read_model_config(args.draft)
    try:
        return SpeculativeConfig(method, args.num_speculative_tokens, args.draft,
                                 args.prompt_lookup_min, args.prompt_lookup_max)
    except ConfigError as error:
        raise ConfigError("--" + str(error).replace("_", "-")) from None


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    for flag in ("max_num_seqs", "max_num_batched_tokens", "block_size", "decode_steps"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization={args.gpu_memory_utilization} must be "
                          "in (0, 1]")
    speculative = _speculative_config(args)
    try:
        return EngineConfig(block_size=args.block_size,
                            kv_cache_memory_mb=args.kv_cache_memory_mb,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            max_decode_stall=args.max_decode_stall,
                            speculative=speculative, compile_decode=not args.enforce_eager,
                            compile_in_background=not args.compile_before_ready,
                            decode_steps=args.decode_steps)
    except ConfigError as error:  # in the flags' spelling
        raise ConfigError(str(error).replace("decode_steps=", "--decode-steps=").replace(
            "max_decode_stall=", "--max-decode-stall=").replace(
            "drop speculative", "drop --speculative/--draft")) from None


def _lora_flags(values: list[str]) -> dict[str, Path]:
    loras: dict[str, Path] = {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or not name or not folder:
            raise ConfigError(f"--lora {value!r}: give NAME=DIR (a name for requests' model "
                              "field, and the peft adapter folder)")
        if name in loras:
            raise ConfigError(f"--lora {name}=...: the name {name!r} is given twice")
        loras[name] = Path(folder)
    return loras


def serve_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lathe serve", description="Serve a checkpoint behind an OpenAI-compatible API.")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("LATHE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $LATHE_API_KEY)")
    parser.add_argument("--protect-metrics", action="store_true",
                        help="/metrics needs the API key too (default: open, for scrapers)")
    parser.add_argument("--served-model-name", help="model id clients send (default: folder name)")
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="queued requests before answering 429")
    parser.add_argument("--engine-threads", type=int, metavar="N",
                        help="intra-op threads of the engine core, which runs in a process "
                             "of its own beside the HTTP server (default: torch's, or "
                             "OMP_NUM_THREADS; on a CPU one fewer for a model under 32 MiB "
                             "of weights, whose steps are mostly Python: the HTTP side keeps "
                             "a core)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--log-level", default="info")
    limits = ConnectionLimits()
    group = parser.add_argument_group("connections")
    group.add_argument("--max-connections", type=int, default=limits.max_connections,
                       help="open connections; past them only GET /health is answered, "
                            "the rest get 503")
    group.add_argument("--max-connections-per-client", type=int,
                       default=limits.max_connections_per_client,
                       help="connections one client address may hold (0: half of "
                            "--max-connections); past a cap the quietest idle connection is "
                            "closed first")
    group.add_argument("--header-timeout", type=float, default=limits.header_seconds,
                       help="seconds a connection has to send a request's headers")
    group.add_argument("--body-timeout", type=float, default=limits.body_seconds,
                       help="seconds a request has to send its body after its headers")
    group.add_argument("--keep-alive-timeout", type=float, default=limits.idle_seconds,
                       help="seconds an idle connection stays open between requests")
    group.add_argument("--shutdown-timeout", type=float, default=limits.drain_seconds,
                       help="seconds requests in flight may finish after SIGTERM before they "
                            "are aborted (a second signal exits at once)")
    group.add_argument("--template-timeout", type=float, default=2.0,
                       help="seconds the chat template may take to render a request")
    parser.add_argument("--chat-template", type=Path, metavar="FILE",
                        help="a Jinja chat template served in place of the checkpoint's")
    group.add_argument("--grammar-timeout", type=float, default=5.0,
                       help="seconds a request's structured output may take to compile")
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                       help="serve a peft adapter folder over the base under NAME (a request's "
                            "model picks it); repeatable")
    group.add_argument("--max-loras", type=int,
                       help="adapter slots held at once, loaded at start or through "
                            "/v1/load_lora_adapter (default: the number of --lora)")
    group.add_argument("--max-lora-rank", type=int, default=EngineConfig.max_lora_rank,
                       help="the highest adapter rank a slot takes")
    group.add_argument("--max-loaded-loras", type=int,
                       help="adapters held in host memory; loading one more unloads the least "
                            "recently used idle one (default: no limit)")
    group.add_argument("--lora-root", action="append", default=[], type=Path, metavar="DIR",
                       help="a folder /v1/load_lora_adapter may load adapters from; repeatable "
                            "(none: loading at run time is off)")
    parser.add_argument("--weights-root", action="append", default=[], type=Path,
                        metavar="DIR",
                        help="a folder POST /update_weights may load new weights from (a "
                             "trainer's pushes, e.g. GRPO's rollout.url); repeatable, needs "
                             "--api-key (none: updates are off)")
    group.add_argument("--allow-unauthenticated-lora-loading", action="store_true",
                       help="let /v1/load_lora_adapter run without --api-key (it is refused "
                            "then: anyone reaching the port could load adapters)")
    parser.add_argument("--tool-call-parser", choices=PARSERS,
                        help="how this model writes tool calls (hermes: Qwen2.5/Qwen3/"
                             "Hermes <tool_call>; llama3_json: Llama 3.1+; mistral: "
                             "[TOOL_CALLS]); without it only tool_choice=none is served")
    parser.add_argument("--max-tool-calls", type=int, default=8,
                        help="calls one reply may make when tool_choice is \"required\"")
    parser.add_argument("--reasoning-parser", choices=(*REASONING_PARSERS, "none"),
                        help="how this model writes its reasoning, split into "
                             "reasoning_content (qwen3, deepseek_r1: <think> blocks; default: "
                             "qwen3 when the chat template renders </think>, else none)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own chat_template (rendered with the "
                             "same time and memory limits)")
    _engine_flags(parser)
    args = parser.parse_args(argv)
    if END_WITH in os.environ:  # started by a trainer (serve.remote.LocalServer): end with it
        end_with(int(os.environ[END_WITH]))
    if args.chat_template is not None:
        read_template_file(args.chat_template)
    if args.protect_metrics and not args.api_key:
        raise ConfigError("--protect-metrics needs --api-key (or LATHE_API_KEY): without a key "
                          "/metrics would stay open; give a key or drop --protect-metrics")
    read_model_config(args.checkpoint)  # fail before binding a port on a wrong path
    if args.engine_threads is not None and args.engine_threads < 1:
        raise ConfigError(f"--engine-threads={args.engine_threads} must be >= 1")
    if args.max_tool_calls < 1:
        raise ConfigError(f"--max-tool-calls={args.max_tool_calls} must be >= 1")
    if args.max_connections < 1:
        raise ConfigError(f"--max-connections={args.max_connections} must be >= 1")
    for flag in ("header_timeout", "body_timeout", "keep_alive_timeout", "shutdown_timeout",
                 "template_timeout", "grammar_timeout"):
        if not getattr(args, flag) > 0:
            raise ConfigError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be > 0")
    if args.max_connections_per_client < 0:
        raise ConfigError(f"--max-connections-per-client={args.max_connections_per_client} "
                          "must be >= 0 (0: half of --max-connections)")
    limits = ConnectionLimits(args.max_connections, args.header_timeout, args.body_timeout,
                              args.keep_alive_timeout, args.shutdown_timeout,
                              args.max_connections_per_client)
    loras = _lora_flags(args.lora)
    max_loras = len(loras) if args.max_loras is None else args.max_loras
    if max_loras < len(loras):
        raise ConfigError(f"--max-loras={max_loras} holds fewer adapters than the {len(loras)} "
                          "--lora given; raise it")
    if args.max_loaded_loras is not None and args.max_loaded_loras < max(len(loras), 1):
        raise ConfigError(f"--max-loaded-loras={args.max_loaded_loras} holds fewer adapters "
                          f"than the {len(loras)} --lora given (and at least 1); raise it")
    for root in args.lora_root:
        if not root.is_dir():
            raise ConfigError(f"--lora-root {root}: not a folder; give the folder adapters "
                              "are loaded from")
    for root in args.weights_root:
        if not root.is_dir():
            raise ConfigError(f"--weights-root {root}: not a folder; give the folder pushed "
                              "weights are written to")
    if args.weights_root and args.api_key is None:
        raise ConfigError("--weights-root needs --api-key: anyone reaching the port could "
                          "otherwise replace the model")
    engine = _engine_config(args)
    try:
        engine = dataclasses.replace(engine, max_loras=max_loras,
                                     max_lora_rank=args.max_lora_rank,
                                     max_loaded_loras=args.max_loaded_loras)
    except ConfigError as error:
        raise ConfigError(str(error).replace("max_loras=", "--max-loras=").replace(
            "max_lora_rank=", "--max-lora-rank=")) from None
    # inductor's compiled code beside lathe's cached graphs, which name it: a cache in /tmp
    # (inductor's default) would not outlive a reboot
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
    from lathe.serve.server import ServerConfig, run
    config = ServerConfig(checkpoint=args.checkpoint, host=args.host, port=args.port,
                          api_key=args.api_key, protect_metrics=args.protect_metrics,
                          served_model_name=args.served_model_name,
                          quantize=args.quantize, dtype=DTYPES[args.dtype],
                          max_waiting=args.max_waiting,
                          max_body_bytes=args.max_body_bytes,
                          template_seconds=args.template_timeout,
                          chat_template=args.chat_template,
                          grammar_seconds=args.grammar_timeout,
                          tool_call_parser=args.tool_call_parser,
                          max_tool_calls=args.max_tool_calls,
                          reasoning_parser=args.reasoning_parser,
                          trust_request_chat_template=args.trust_request_chat_template,
                          loras=loras, lora_roots=args.lora_root,
                          allow_unauthenticated_lora_loading=(
                              args.allow_unauthenticated_lora_loading),
                          weight_roots=args.weights_root,
                          engine_threads=args.engine_threads,
                          limits=limits, engine=engine)
    run(config, args.log_level)
    return 0


def chat_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lathe chat", description="Chat in the terminal with a checkpoint folder or a "
                                       "running `lathe serve` (http://HOST:PORT).")
    parser.add_argument("target", help="checkpoint folder or server URL")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--prompt", help="send this one message, print the answer and exit")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--api-key", default=os.environ.get("LATHE_API_KEY"))
    parser.add_argument("--model", help="model id on the server (default: its first)")
    parser.add_argument("--quantize", choices=["int8", "int4"], help="local checkpoints only")
    parser.add_argument("--dtype", choices=list(DTYPES), default="auto",
                        help="local checkpoints: " + DTYPE_HELP)
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
    tools = _read_tools(args.tools) if args.tools is not None else None
    from lathe.data.tool_runner import ToolRunner
    from lathe.data.tools import load_tools
    from lathe.serve.chat import LocalChat, RemoteChat, chat_loop, say, write_stdout
    from lathe.serve.sampling import SamplingError, SamplingParams

    runner = ToolRunner(load_tools(args.tool)) if args.tool else None
    if runner is not None:
        tools = (tools or []) + runner.definitions()

    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "max_tokens": args.max_tokens, "seed": args.seed}
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
                            DTYPES[args.dtype])
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
        "weight-only quantized checkpoint folder (lathe serve loads it) or one GGUF file "
        "(llama.cpp, Ollama).")
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--format", default="hf", choices=["hf", "quantized", "gguf"],
                        help="hf: a plain checkpoint folder (with --merge-lora)")
    parser.add_argument("--merge-lora", type=Path, metavar="ADAPTER",
                        help="fold this peft adapter folder into the weights first")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--quantize", choices=["int8", "int4"], default="int8",
                        help="--format quantized: weight-only scheme")
    parser.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128],
                        help="--format quantized, int4: input columns per scale")
    parser.add_argument("--dtype", choices=["f32", "f16", "bf16", "q8_0"], default="f16",
                        help="--format gguf: tensor type of the weight matrices")
    parser.add_argument("--eval-text", type=Path,
                        help="--format quantized: report perplexity on this text file "
                             "before and after quantization")
    args = parser.parse_args(argv)
    read_model_config(args.checkpoint)
    from lathe.model.checkpoint import load_checkpoint
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
