"""`python -m lathe.serve.bench`: serving speed and quantization quality, in one process.

(a) offline throughput: N prompts × M new tokens through `LLMEngine.generate` (eager;
    eager with its linears on BLAS, as it was before the native decode linears; with
    decode steps compiled; and with offline settings: compiled, `--decode-steps` forward
    passes per engine step, and a `--offline-batched-tokens` budget that prefills the whole
    batch in one or two steps, as transformers does) and through `transformers`'
    `generate()` with left-padded batches, on the same checkpoint, in interleaved rounds;
(b) servers under load, each started as a user starts it: `lathe serve` (compiled decode
    steps, warmed up) and `lathe serve --enforce-eager`, and llama.cpp's `llama-server` on
    the f32 GGUF of the same weights when the binary is on PATH (`--server-weights bf16`:
    both lathe servers with --dtype bfloat16, llama-server on the bf16 GGUF; `int8`: both
    with --quantize int8, llama-server on q8_0; llama.cpp builds it with
    `cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-server`); a
    streaming client at concurrency 1, 4, 16 and 64 (with `--data-parallel-size N`, also
    `lathe serve` of N engine cores), reporting output tok/s, time to first
    token and inter-token latency (p50 / p99, as `vllm bench serve` defines them): all
    servers up at once, measured in turn in interleaved rounds, each round's ratio against
    the baseline measured beside it;
(c) single-stream decode tok/s for the checkpoint's weights, bf16 (on the CPU: half
    weights, float32 compute), int8, int4 and fp8 (W8A8), eager, with decode steps
    compiled (`EngineConfig.compile_decode`: CUDA graphs on a GPU) and compiled with
    multi-step decoding (`EngineConfig.decode_steps`), and the memory bandwidth it
    implies (weight bytes streamed per token × tok/s) as a fraction of this machine's
    measured copy bandwidth; with `--eval-shards`, perplexity on the validation tokens; on
    CPU, when llama-cpp-python is installed (`pip install -e .[bench]`; it builds from
    source), llama.cpp on the f32 GGUF of the same weights;
(d) on a GPU, batched decode tok/s with the Triton paged-attention kernel against the
    gather + SDPA path it replaces (`LATHE_KERNELS_DISABLE=paged_decode`), at several batch
    sizes over long prompts;
(e) with `--draft STUDENT`, speculative decoding: greedy output tok/s at batch 1 and 8
    without speculation, with the draft model and with prompt lookup (n-gram), on prompts
    cut from `--eval-shards` validation text, with each one's acceptance rate and mean
    acceptance length;
(f) with a `--checkpoint` that has a tokenizer, structured outputs: the server at
    concurrency 16 with 0%, 50% and 100% of requests JSON-schema constrained (their output
    tok/s against the unconstrained run), time to first token for a schema never seen
    against the same schema again (compiled and cached), and llguidance's compile and
    per-token mask times beside xgrammar's (when installed) on the checkpoint's tokenizer;
(g) LoRA adapters: the server (decode steps compiled, then eager) at concurrency 16 with
    requests spread over 1, 4 and 16 distinct rank-16 adapters (random weights on every
    projection, `--max-loras 16`) against the base alone on the same server;
(h) start: seconds from `lathe serve` to its first answered completion (16 greedy tokens)
    with empty caches (a fresh `$LATHE_CACHE_DIR` and inductor cache), as started by
    default (compiled steps built in the background), with --enforce-eager and with
    --compile-before-ready, with `--lora` flags (`--start-loras`) when given; and how long a
    second request takes, while the default server's graphs are still building;
(i) an agent's loop, one request at a time, each prompt the last one grown by its answer
    and a tool's result: seconds per turn with the prefix cache (for linear-attention
    layers, their kept states) against every prompt computed whole and against
    transformers' `generate()`.

`--sections` picks which run (default: all that apply).

Without `--checkpoint` it benchmarks a randomly initialized `nano` model (token-id prompts).
Tables are printed and appended to the history in `--out` (`lathe.core.bench_history`;
`--out docs` from a checkout's root: the project's own).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import torch
from torch import Tensor, nn

from lathe.core.bench_history import add_history_arguments, history_folder, record
from lathe.kernels import kernels_off
from lathe.kernels.decode_linear import DecodeLinear
from lathe.model.checkpoint import load_checkpoint, read_model_config, save_checkpoint
from lathe.model.config import ModelConfig
from lathe.model.transformer import Transformer
from lathe.serve.config import EngineConfig, SpeculativeConfig
from lathe.serve.engine import LLMEngine
from lathe.serve.quant import load_serving_model, perplexity
from lathe.serve.sampling_params import SamplingParams

# timed passes per measurement, the best reported: on a shared machine one pass moves by ±30%
REPEATS = 3
PROMPT_TOKENS = (32, 128)  # the servers' prompt lengths in (b) and (g), shortest and longest


def random_prompts(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def blas_linears(engine: LLMEngine) -> LLMEngine:
    """`engine` with its model's projections back on `F.linear`: the default engine without
    `DecodeLinear`'s native few-row op, the baseline that op is measured against."""
    for module in engine.model.modules():
        if type(module) is DecodeLinear:
            module.__class__ = nn.Linear
    return engine


def offline(checkpoint: Path, prompts: list[list[int]], new_tokens: int,
            device: torch.device, decode_steps: int, batched_tokens: int) -> list[str]:
    """Each engine and transformers' `generate` on the same prompts, in `REPEATS` rounds of
    one pass each, best pass reported: a shared machine's drift then hits every row alike.
    Each warms up on the whole workload first (Triton compiles and autotunes per shape
    class and length bucket, a compiled decode step per batch bucket); every lathe pass
    prefills its prompts, as `generate` on the other side does."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    # all engines live at once: a KV cache the workload's size each, not a memory budget
    blocks = 2 * sum(-(-(len(p) + new_tokens) // EngineConfig.block_size) for p in prompts)
    configs = {
        "lathe `LLMEngine.generate` (paged KV, continuous batching)":
            EngineConfig(num_blocks=blocks),
        "lathe, decode steps compiled (`compile_decode`)":
            EngineConfig(num_blocks=blocks, compile_decode=True),
        f"lathe, compiled, {decode_steps} passes a step (`decode_steps`), {batched_tokens}-"
        "token budget (`max_num_batched_tokens`)":
            EngineConfig(num_blocks=blocks, compile_decode=True, decode_steps=decode_steps,
                         max_num_batched_tokens=batched_tokens)}
    engines = {name: LLMEngine.from_checkpoint(checkpoint, config, device=device)
               for name, config in configs.items()}
    engines["lathe, linears on BLAS (`F.linear`, no native decode linears)"] = blas_linears(
        LLMEngine.from_checkpoint(checkpoint, EngineConfig(num_blocks=blocks), device=device))
    outputs = {name: engine.generate(prompts, params) for name, engine in engines.items()}

    from transformers import AutoModelForCausalLM
    # transformers loads the checkpoint in the dtype lathe's engine runs it in
    dtype = next(iter(engines.values())).model.model.embed_tokens.weight.dtype
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    # as lathe's ignore_eos (and vLLM's): EOS neither stops a row nor is masked out
    # (min_new_tokens would mask it, so a trained model's greedy tokens would differ)
    model.generation_config.eos_token_id = None
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generate() expects
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)

    def hf_generate() -> Tensor:
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=0)

    def lathe_generate(engine: LLMEngine) -> None:
        engine.block_manager.reset_prefix_cache()
        engine.generate(prompts, params)

    theirs = hf_generate()
    runs = {**{name: functools.partial(lathe_generate, engine)
               for name, engine in engines.items()},
            "transformers `generate()` (padded batch, SDPA)": hf_generate}
    best = dict.fromkeys(runs, math.inf)
    for _ in range(REPEATS):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    ours, compiled, multi, blas = outputs.values()
    same = sum(o.outputs[0].token_ids == t[width:].tolist() for o, t in zip(ours, theirs,
                                                                           strict=True))
    same_lathe = sum(a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
                     == d.outputs[0].token_ids
                     for a, b, c, d in zip(ours, compiled, multi, blas, strict=True))
    total = len(prompts) * new_tokens
    return [*(f"| {name} | {total / seconds:,.0f} | {seconds:.2f} |"
              for name, seconds in best.items()),
            f"| greedy outputs identical: lathe / transformers, eager / compiled / multi-step "
            f"/ BLAS linears | {same}/{len(prompts)}, {same_lathe}/{len(prompts)} | |"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint: Path, engine_config: EngineConfig,
                 **config: object) -> tuple[object, str]:
    """The real server on `checkpoint` in a thread, once healthy; `config`: more
    `ServerConfig` fields (LoRA adapters, ...)."""
    import uvicorn

    from lathe.serve.config import ServerConfig
    from lathe.serve.server import build_app
    port = free_port()
    app = build_app(ServerConfig(checkpoint=checkpoint, port=port, served_model_name="bench",
                                 max_waiting=4096, engine=engine_config, **config))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)


async def load_test(url: str, prompts: list[list[int]], new_tokens: int,
                    concurrency: int, extra: Callable[[int], dict] | None = None,
                    ) -> dict[str, float]:
    """Stream every prompt at `concurrency`; `extra(i)`: fields added to request i's body."""
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    itls: list[float] = []
    produced = 0

    async def one(client: httpx.AsyncClient, i: int, prompt: list[int]) -> None:
        nonlocal produced
        body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        if extra is not None:
            body = {**body, **extra(i)}
        async with gate:
            last, count, used = time.perf_counter(), 0, None
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    used = (chunk.get("usage") or {}).get("completion_tokens", used)
                    choices = chunk["choices"]
                    # a token per chunk; llama-server ends with a chunk of no text
                    if not choices or (choices[0]["finish_reason"] and not choices[0]["text"]):
                        continue
                    now = time.perf_counter()
                    (itls if count else ttfts).append(now - last)
                    last, count = now, count + 1
            produced += count if used is None else used

    # a connection per request: llama-server closes kept-alive ones between requests, and
    # a request sent on one it just closed fails
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(
            max_keepalive_connections=0)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))
        seconds = time.perf_counter() - start

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) * 1000 if values else float("nan")
    return {"tok_s": produced / seconds, "ttft50": pct(ttfts, 50), "ttft99": pct(ttfts, 99),
            "itl50": pct(itls, 50), "itl99": pct(itls, 99), "requests": len(prompts)}


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second moved by a large tensor copy (read + write)."""
    src = torch.ones(64 * 2**20, device=device)  # 256 MiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def streamed_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every tensor but the embedding table, of which
    one row is read (unless it is also the LM head)."""
    embedding = model.model.embed_tokens.weight
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    head = getattr(model.lm_head, "weight", None)
    if head is not embedding:
        tensors.pop(id(embedding), None)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_speed(checkpoint: Path, quantize: str | None, prompt: list[int],
                 new_tokens: int, device: torch.device, config: EngineConfig | None = None,
                 dtype: torch.dtype | None = None) -> tuple[float, int, str]:
    """Best decode tok/s of one sequence, the weight bytes a step streams, and the name of
    the weights' format (the quantization, or the unquantized dtype)."""
    # a KV cache the one sequence's size: engines built one after another in one process
    # then never wait on the last one's memory (on a GPU the default takes 90% of it)
    blocks = 2 * -(-(len(prompt) + new_tokens) // EngineConfig.block_size)
    config = dataclasses.replace(config or EngineConfig(), num_blocks=blocks)
    engine = LLMEngine.from_checkpoint(checkpoint, config, quantize=quantize, dtype=dtype,
                                       device=device)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    # warm up over the whole workload: a compiled engine compiles per table width, which
    # the context reaches only as it grows
    engine.generate([prompt], params)
    best = 0.0
    for _ in range(REPEATS):
        engine.add_request(prompt, params)
        engine.step()  # prefill and first token
        start = time.perf_counter()
        tokens = 0  # a multi-step engine step emits several
        while engine.has_unfinished():
            tokens += sum(len(delta.token_ids) for delta in engine.step())
        best = max(best, tokens / (time.perf_counter() - start))
    weights = quantize or str(engine.model.lm_head.weight.dtype).removeprefix("torch.")
    return best, streamed_bytes(engine.model), weights


def batched_decode_speed(checkpoint: Path, batch: int, prompt_tokens: int,
                         new_tokens: int, device: torch.device) -> float:
    """Decode tok/s of `batch` concurrent sequences after `prompt_tokens`-token prompts:
    a full generate minus a prefill-only one, so prefill time is not counted. Each timed
    call gets prompts of its own, so the prefix cache never skips the prefill of one and
    not the other."""
    config = EngineConfig(num_blocks=batch * ((prompt_tokens + new_tokens) // 16 + 2))
    engine = LLMEngine.from_checkpoint(checkpoint, config=config, device=device)
    vocab = engine.model.config.vocab_size
    engine.generate(random_prompts(1, prompt_tokens, prompt_tokens, vocab, seed=10**6),
                    SamplingParams(max_tokens=2, temperature=0))  # warm up

    def seconds(tokens: int, seed: int) -> float:
        prompts = random_prompts(batch, prompt_tokens, prompt_tokens, vocab, seed=seed)
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0,
                                                ignore_eos=True))
        return time.perf_counter() - start
    prefill = seconds(1, seed=2 * batch)
    return batch * (new_tokens - 1) / (seconds(new_tokens, seed=2 * batch + 1) - prefill)


def speculative_speed(checkpoint: Path, speculative: SpeculativeConfig | None,
                      prompts: list[list[int]], new_tokens: int,
                      device: torch.device) -> tuple[float, dict[str, float]]:
    """Greedy output tok/s of `prompts` (prefill included) and the speculation counters of
    that run alone (warm-up excluded)."""
    engine = LLMEngine.from_checkpoint(checkpoint, EngineConfig(speculative=speculative),
                                       device=device)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=8, temperature=0))
    before = engine.stats()
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0,
                                            ignore_eos=True))
    seconds = time.perf_counter() - start
    after = engine.stats()
    counts = {key: after[key] - before[key] for key in after
              if key.startswith("spec_decode_num_")}
    return len(prompts) * new_tokens / seconds, counts


def speculative_rows(checkpoint: Path, draft: Path, k: int, prompts: list[list[int]],
                     batches: list[int], new_tokens: int, device: torch.device) -> list[str]:
    rows = []
    for batch in batches:
        group = prompts[:batch]
        plain, _ = speculative_speed(checkpoint, None, group, new_tokens, device)
        rows.append(f"| {batch} | none | {plain:,.1f} | 1.00× | — | — |")
        print(rows[-1], flush=True)
        for name, config in ((f"draft `{draft.name}`", SpeculativeConfig("draft", k, draft)),
                             ("ngram (prompt lookup)", SpeculativeConfig("ngram", k))):
            tok_s, counts = speculative_speed(checkpoint, config, group, new_tokens, device)
            drafted = counts["spec_decode_num_draft_tokens"]
            accepted = counts["spec_decode_num_accepted_tokens"]
            steps = counts["spec_decode_num_drafts"]
            rows.append(f"| {batch} | {name}, k={k} | {tok_s:,.1f} | {tok_s / plain:.2f}× | "
                        f"{accepted / drafted if drafted else 0:.1%} | "
                        f"{1 + accepted / steps if steps else 1:.2f} |")
            print(rows[-1], flush=True)
    return rows


def text_prompts(shards: Path | None, count: int, length: int, vocab: int) -> list[list[int]]:
    """`count` prompts of `length` tokens from distinct places of the validation text (random
    token ids without shards)."""
    if shards is None:
        return random_prompts(count, length, length, vocab, seed=7)
    tokens = val_tokens(shards, 10**7)
    stride = max(length, (len(tokens) - length) // count)
    return [tokens[i * stride:i * stride + length] for i in range(count)]


def val_tokens(shards: Path, limit: int) -> list[int]:
    from lathe.data.shards import read_shard
    files = sorted(shards.glob("val-*.bin"))
    if not files:
        raise SystemExit(f"--eval-shards {shards}: no val-*.bin files (written by lathe shards)")
    return np.concatenate([read_shard(f) for f in files])[:limit].tolist()


def random_checkpoint(folder: Path) -> Path:
    torch.manual_seed(0)
    return save_checkpoint(Transformer(ModelConfig.from_preset("nano")), folder / "nano")


def run(args: argparse.Namespace) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tmp = tempfile.TemporaryDirectory()
    checkpoint = args.checkpoint or random_checkpoint(Path(tmp.name))
    vocab = load_checkpoint(checkpoint).config.vocab_size
    prompts = random_prompts(args.prompts, 32, 128, vocab)
    sections = []

    if "a" in args.sections:
        rows = offline(checkpoint, prompts, args.new_tokens, device, args.decode_steps,
                       args.offline_batched_tokens)
        print(*rows, sep="\n", flush=True)
        sections += [f"### (a) Offline: {args.prompts} prompts of 32–128 tokens × "
                     f"{args.new_tokens} new tokens, greedy", "",
                     "| engine | output tok/s | seconds |", "|---|---:|---:|", *rows, ""]
    if "b" in args.sections:
        sections += server_section(checkpoint, vocab, args)
    if "c" in args.sections:
        sections += decode_section(checkpoint, prompts[0], device, args)
    if "d" in args.sections and device.type == "cuda":
        sections += batched_decode_section(checkpoint, device, args)
    if "f" in args.sections and args.checkpoint is not None and \
            (args.checkpoint / "tokenizer.json").is_file():
        sections += structured_section(checkpoint, vocab, args)
    if "g" in args.sections:
        sections += adapter_section(checkpoint, vocab, args)
    if "h" in args.sections:
        sections += start_section(checkpoint, args)
    if "i" in args.sections:
        sections += conversation_section(checkpoint, vocab, device, args)
    if "e" in args.sections and args.draft is not None:
        spec_prompts = text_prompts(args.eval_shards, max(args.spec_batches), 64, vocab)
        rows = speculative_rows(checkpoint, args.draft, args.num_speculative_tokens,
                                spec_prompts, args.spec_batches, args.spec_tokens, device)
        source = "validation text" if args.eval_shards else "random token ids"
        sections += [f"### (e) Speculative decoding: greedy, 64-token prompts from {source}, "
                     f"{args.spec_tokens} new tokens each (prefill included)", "",
                     "| batch | speculation | output tok/s | vs none | acceptance rate | "
                     "mean acceptance length |", "|---:|---|---:|---:|---:|---:|", *rows, ""]
    tmp.cleanup()

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"{platform.machine()}, {torch.get_num_threads()} threads")
    source = args.checkpoint or "random-init nano (11M parameters)"
    table = "\n".join([
        f"## Serving — {datetime.date.today()} — {name}, torch {torch.__version__}", "",
        f"Command: `python -m lathe.serve.bench` — checkpoint: {source}", "", *sections])
    record(table, history_folder(args))
    return table


def conversation_section(checkpoint: Path, vocab: int, device: torch.device,
                         args: argparse.Namespace) -> list[str]:
    """(i): an agent's loop, one request at a time: a `--turn-context`-token first prompt,
    each later prompt the last one, its `--turn-answer`-token greedy answer and
    `--turn-tokens` new tokens (a tool's result). lathe's engine with its prefix cache (a
    model with linear-attention layers: from their kept states), eager and with its decode
    steps compiled (`lathe serve`'s default, built before the loop), against the same engine
    computing every prompt whole (`--no-enable-prefix-caching`) and transformers'
    `generate()` on each whole prompt; each turn's seconds, best of `REPEATS` rounds. The
    first prompt is cut so that the loop fits the model's positions (the random `nano`'s
    512); none left, the section is skipped."""
    grown = args.turns * (args.turn_answer + args.turn_tokens)
    context = min(args.turn_context, read_model_config(checkpoint).max_seq_len - grown)
    if context < 1:
        print(f"(i) skipped: {args.turns} turns of {args.turn_answer + args.turn_tokens} "
              "tokens exceed the model's positions", flush=True)
        return []
    generator = torch.Generator().manual_seed(7)
    first = torch.randint(3, vocab, (context,), generator=generator).tolist()
    results = [torch.randint(3, vocab, (args.turn_tokens,), generator=generator).tolist()
               for _ in range(args.turns)]
    params = SamplingParams(max_tokens=args.turn_answer, temperature=0, ignore_eos=True)
    length = context + grown
    blocks = 2 * -(-length // EngineConfig.block_size)
    engines = {name: LLMEngine.from_checkpoint(checkpoint, EngineConfig(
        num_blocks=blocks, prefix_caching=caching, max_num_batched_tokens=length,
        max_num_seqs=4, compile_decode=compiled), device=device)  # one request at a time
        for name, caching, compiled in (("lathe, prefix cache", True, False),
                                        ("lathe, prefix cache, decode steps compiled", True,
                                         True),
                                        ("lathe, every prompt whole", False, False))}
    for engine in engines.values():
        engine.warm_up()

    def lathe_turns(engine: LLMEngine) -> tuple[list[float], list[list[int]]]:
        engine.block_manager.reset_prefix_cache()
        if engine.snapshots is not None:
            engine.snapshots.clear()
        prompt, seconds, answers = first, [], []
        for result in results:
            start = time.perf_counter()
            answer = engine.generate([prompt], params)[0].outputs[0].token_ids
            seconds.append(time.perf_counter() - start)
            answers.append(answer)
            prompt = prompt + answer + result
        return seconds, answers

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=next(iter(
        engines.values())).model.model.embed_tokens.weight.dtype).to(device).eval()
    model.generation_config.eos_token_id = None

    def transformers_turns(answers: list[list[int]]) -> tuple[list[float], list[list[int]]]:
        prompt, seconds, theirs = first, [], []
        for answer, result in zip(answers, results, strict=True):
            ids = torch.tensor([prompt], device=device)
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=args.turn_answer, do_sample=False,
                                     pad_token_id=0)
            seconds.append(time.perf_counter() - start)
            theirs.append(out[0, len(prompt):].tolist())
            prompt = prompt + answer + result  # lathe's answers: the same prompts
        return seconds, theirs

    best: dict[str, list[float]] = {}
    answers: dict[str, list[list[int]]] = {}

    def timed(name: str, result: tuple[list[float], list[list[int]]]) -> None:
        """Each turn's best seconds so far, and the round's answers."""
        seconds, answers[name] = result
        best[name] = [min(a, b) for a, b in zip(best.get(name, seconds), seconds, strict=True)]
    for _ in range(REPEATS):
        for name, engine in engines.items():
            timed(name, lathe_turns(engine))
        timed("transformers `generate()` on each whole prompt",
              transformers_turns(answers["lathe, prefix cache"]))
    reference = answers["lathe, every prompt whole"]
    rows = []
    for name, seconds in best.items():
        same = sum(a == b for a, b in zip(answers[name], reference, strict=True))
        later = sum(seconds[1:]) / max(len(seconds) - 1, 1)
        rows.append(f"| {name} | {seconds[0]:.3f} | {later:.3f} | {sum(seconds):.2f} | "
                    f"{same}/{args.turns} |")
        print(f"(i) {rows[-1]}", flush=True)
    return [f"### (i) An agent's loop: a {context}-token prompt, then {args.turns - 1}"
            f" turns each adding the {args.turn_answer}-token answer and {args.turn_tokens} "
            "new tokens, greedy, one request at a time", "",
            "| engine | first turn, s | later turns, mean s | total s | answers as computed "
            "whole |", "|---|---:|---:|---:|---:|", *rows, ""]


def first_answers(command: list[str], url: str, env: dict[str, str]) -> tuple[float, float]:
    """Seconds from starting `command` to its first answered completion, and the second
    completion's own seconds."""
    body = {"model": "bench", "prompt": [5, 6, 7], "max_tokens": 16, "temperature": 0}
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{' '.join(command)} exited ({process.returncode})")
            try:
                if httpx.post(f"{url}/v1/completions", json=body, timeout=900).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        first = time.perf_counter() - started
        started = time.perf_counter()
        httpx.post(f"{url}/v1/completions", json={**body, "prompt": [8, 6, 7]}, timeout=900)
        return first, time.perf_counter() - started
    finally:
        process.terminate()
        process.wait()


def start_section(checkpoint: Path, args: argparse.Namespace) -> list[str]:
    """(h): each start with caches of its own, empty."""
    loras = [flag for spec in args.start_loras for flag in ("--lora", spec)]
    rows = []
    for flags in ([], ["--enforce-eager"], ["--compile-before-ready"]):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "LATHE_CACHE_DIR": cache}
            env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # lathe serve puts it under the former
            port = free_port()
            command = [sys.executable, "-m", "lathe.core", "serve", str(checkpoint), "--port",
                       str(port), "--served-model-name", "bench", "--log-level", "warning",
                       *loras, *flags]
            first, second = first_answers(command, f"http://127.0.0.1:{port}", env)
        rows.append(f"| {' '.join(['lathe serve', *flags])} | {first:.1f} | {second:.2f} |")
        print(f"(h) {rows[-1]}", flush=True)
    adapters = f", {len(args.start_loras)} LoRA adapters" if loras else ""
    return [f"### (h) Start{adapters}: seconds to the first answer, empty caches", "",
            "| server | first answer, s from start | second request, s |", "|---|---:|---:|",
            *rows, ""]


def server_process(command: list[str], url: str, log: Path) -> subprocess.Popen:
    """A server started as a user starts it, once its /health answers 200."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    why = f"exited ({process.returncode})" if process.poll() is not None else \
        "did not become healthy in 900 s"
    process.kill()
    raise SystemExit(f"{command[0]} {why}:\n{log.read_text()[-2000:]}")


# (b)'s `--server-weights`: lathe serve's flags, and the GGUF type llama-server reads
SERVER_WEIGHTS = {"f32": ([], "f32"), "bf16": (["--dtype", "bfloat16"], "bf16"),
                  "int8": (["--quantize", "int8"], "q8_0")}


def server_commands(checkpoint: Path, folder: Path, args: argparse.Namespace,
                    ) -> dict[str, tuple[list[str], str]]:
    """The servers (b) compares, each a command line and its URL: `lathe serve` compiled
    (its graphs all built before it is healthy, so that no round runs eagerly while they
    build) and with --enforce-eager (with `--server-weights`'s flags), and, when
    a `llama-server` binary is on PATH and the checkpoint has a tokenizer, llama.cpp's server
    on the GGUF of the same weights (`SERVER_WEIGHTS`)
    with as many slots as the bench's highest concurrency (each holding a prompt and its
    output) and the same threads."""
    commands = {}
    weights, gguf_type = SERVER_WEIGHTS[args.server_weights]
    variants = [("lathe serve", [*weights, "--compile-before-ready"]),
                ("lathe serve --enforce-eager", [*weights, "--enforce-eager"])]
    if args.data_parallel_size > 1:
        variants.append((f"lathe serve --data-parallel-size {args.data_parallel_size}",
                         [*weights, "--compile-before-ready", "--data-parallel-size",
                          str(args.data_parallel_size)]))
    for name, flags in variants:
        name = " ".join([name, *weights])
        port = free_port()
        commands[name] = ([sys.executable, "-m", "lathe.core", "serve", str(checkpoint),
                           "--port", str(port), "--served-model-name", "bench",
                           "--max-waiting", "4096", "--log-level", "warning", *flags],
                          f"http://127.0.0.1:{port}")
    binary = shutil.which("llama-server")
    if binary is None or not (checkpoint / "tokenizer.json").is_file():
        print("(b) llama-server row skipped: no llama-server on PATH, or no tokenizer.json")
        return commands
    from lathe.serve.gguf_export import export_gguf
    gguf = export_gguf(checkpoint, folder / "model.gguf", gguf_type)
    slots, port, threads = max(args.concurrency), free_port(), str(torch.get_num_threads())
    commands[f"llama-server {gguf_type}"] = ([
        binary, "-m", str(gguf), "--port", str(port), "-t", threads, "-tb", threads,
        "--parallel", str(slots), "-c", str(slots * (PROMPT_TOKENS[1] + args.server_tokens
                                                     + 16))],
        f"http://127.0.0.1:{port}")
    return commands


def load_servers(checkpoint: Path, vocab: int, folder: Path, args: argparse.Namespace,
                 ) -> dict[tuple[str, int], list[dict[str, float]]]:
    """The servers of `server_commands`, all up at once (each started and timed alone),
    under load at each concurrency in `--server-rounds` interleaved rounds: in a round each
    server in turn, on the round's prompts (new each round: a prompt seen before would be a
    prefix-cache hit), after one request of its own to wake it; the others sit idle. This
    machine's speed drifts by tens of percent over minutes, so a server measured minutes
    after another can win or lose by the drift alone; the rounds of one server and its
    baseline are taken seconds apart. Each round's figures, by (server, concurrency)."""
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    servers: dict[str, tuple[str, subprocess.Popen]] = {}
    try:
        for index, (name, (command, url)) in enumerate(
                server_commands(checkpoint, folder, args).items()):
            started = time.perf_counter()
            servers[name] = url, server_process(command, url, folder / f"server-{index}.log")
            print(f"(b) {name}: healthy after {time.perf_counter() - started:.1f} s",
                  flush=True)
        for concurrency in args.concurrency:
            for round_ in range(args.server_rounds):
                load = random_prompts(max(2 * concurrency, 8), *PROMPT_TOKENS, vocab,
                                      seed=1000 * round_ + concurrency)
                for index, (name, (url, _)) in enumerate(servers.items()):
                    wake = random_prompts(1, *PROMPT_TOKENS, vocab,
                                          seed=10**6 + 1000 * round_ + 100 * index + concurrency)
                    asyncio.run(load_test(url, wake, 4, 1))
                    results.setdefault((name, concurrency), []).append(
                        asyncio.run(load_test(url, load, args.server_tokens, concurrency)))
            print(f"(b) concurrency {concurrency}: " + ", ".join(
                f"{name} {statistics.median(r['tok_s'] for r in results[name, concurrency]):,.0f}"
                for name in servers) + " tok/s", flush=True)
    finally:
        for _, process in servers.values():
            process.terminate()
        for _, process in servers.values():
            process.wait(timeout=60)
    return results


def server_section(checkpoint: Path, vocab: int, args: argparse.Namespace) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="lathe-bench-") as tmp:
        results = load_servers(checkpoint, vocab, Path(tmp), args)
    servers = list(dict.fromkeys(name for name, _ in results))
    baseline = next((name for name in servers if name.startswith("llama-server")), None)
    rows = []
    for concurrency in args.concurrency:
        for name in servers:
            rounds = results[name, concurrency]
            median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
            ratio = ""
            if baseline is not None:  # round by round: each against the baseline beside it
                ratios = [r["tok_s"] / b["tok_s"]
                          for r, b in zip(rounds, results[baseline, concurrency], strict=True)]
                ratio = f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"
            rows.append(f"| {concurrency} | {name} | {rounds[0]['requests']} | "
                        f"{median['tok_s']:,.0f} | {ratio} | "
                        f"{median['ttft50']:,.0f} / {median['ttft99']:,.0f} | "
                        f"{median['itl50']:,.1f} / {median['itl99']:,.1f} |")
    return [f"### (b) Servers under load: streaming /v1/completions, prompts of "
            f"{PROMPT_TOKENS[0]}–{PROMPT_TOKENS[1]} tokens, {args.server_tokens} output tokens "
            f"each; medians of {args.server_rounds} interleaved rounds (the ratio: each "
            "round's against the baseline's in the same round; in brackets the lowest and "
            f"highest), {torch.get_num_threads()} threads", "",
            "| concurrency | server | requests | output tok/s | vs llama-server | "
            "TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |",
            "|---:|---|---:|---:|---:|---:|---:|", *rows, ""]


def json_format(key: str) -> dict:
    """A JSON-schema response_format whose output cannot end within the bench's max_tokens
    (a string of at least 1,000 characters), so that a constrained request generates as
    many tokens as an unconstrained one; named by `key`, so each key is a schema the
    server has not seen."""
    schema = {"type": "object", "required": [key], "additionalProperties": False,
              "properties": {key: {"type": "string", "minLength": 1000, "maxLength": 2000}}}
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": key, "schema": schema}}}


def first_token_ms(url: str, prompt: list[int], extra: dict) -> float:
    body = {"model": "bench", "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    start = time.perf_counter()
    httpx.post(f"{url}/v1/completions", json=body, timeout=None).raise_for_status()
    return (time.perf_counter() - start) * 1000


def structured_section(checkpoint: Path, vocab: int, args: argparse.Namespace) -> list[str]:
    server, url = start_server(checkpoint, EngineConfig())
    load = random_prompts(64, 32, 128, vocab, seed=16)
    rows, baseline = [], None
    for share in (0.0, 0.5, 1.0):
        every = round(1 / share) if share else 0

        def extra(i: int, every: int = every) -> dict:
            constrained = every and i % every == 0  # a constraint ends at EOS: not ignored
            return {**json_format("text"), "ignore_eos": False} if constrained else {}
        r = asyncio.run(load_test(url, load, args.server_tokens, 16, extra))
        baseline = baseline or r["tok_s"]
        rows.append(f"| {share:.0%} | {r['tok_s']:,.0f} | {r['tok_s'] / baseline:.2f}× | "
                    f"{r['ttft50']:,.0f} / {r['ttft99']:,.0f} | "
                    f"{r['itl50']:,.1f} / {r['itl99']:,.1f} |")
        print(rows[-1], flush=True)
    new = [first_token_ms(url, load[0], json_format(f"field{i}")) for i in range(5)]
    cached = [first_token_ms(url, load[0], json_format(f"field{i}")) for i in range(5)]
    plain = [first_token_ms(url, load[0], {}) for _ in range(5)]
    server.should_exit = True
    libraries = grammar_library_rows(checkpoint, vocab)
    return [f"### (f) Structured outputs: concurrency 16, 64 streaming /v1/completions "
            f"requests, prompts of 32–128 tokens, {args.server_tokens} output tokens each, "
            "a share of them JSON-schema constrained (llguidance; a schema that cannot close "
            "sooner)", "",
            "| constrained | output tok/s | vs none | TTFT p50 / p99 (ms) | "
            "ITL p50 / p99 (ms) |", "|---:|---:|---:|---:|---:|", *rows, "",
            f"Time to first token, median of 5, alone: unconstrained "
            f"{statistics.median(plain):.1f} ms, a schema never seen "
            f"{statistics.median(new):.1f} ms, the same schema again "
            f"{statistics.median(cached):.1f} ms.", "",
            "Grammar libraries on this checkpoint's tokenizer, one JSON schema (nested object, "
            "enum array, pattern), a seeded walk of up to 40 allowed tokens, 3 times:", "",
            "| library | compile (ms) | mask p50 (µs) | mask p99 (µs) |", "|---|---:|---:|---:|",
            *libraries, ""]


BENCH_SCHEMA = {"type": "object", "additionalProperties": False,
                "required": ["name", "age", "tags", "address"], "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "age": {"type": "integer", "minimum": 0},
                    "tags": {"type": "array", "maxItems": 3,
                             "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
                    "address": {"type": "object", "required": ["city", "zip"], "properties": {
                        "city": {"type": "string"},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}


def grammar_library_rows(checkpoint: Path, vocab: int) -> list[str]:
    """Compile time and per-token mask time of llguidance (what lathe uses) and of
    xgrammar, the alternative vLLM and SGLang default to, when it is installed."""
    import random

    from lathe.core.checkpoint_files import read_eos_ids
    from lathe.data.tokenizer import load_tokenizer

    tokenizer, eos = load_tokenizer(checkpoint), sorted(read_eos_ids(checkpoint, vocab))
    words = (vocab + 31) // 32

    def walk(make, fill, consume) -> tuple[float, list[float]]:
        compile_ms, masks = [], []
        for run in range(3):
            start = time.perf_counter()
            matcher = make()
            compile_ms.append((time.perf_counter() - start) * 1000)
            rng, bitmask = random.Random(run), torch.zeros((1, words), dtype=torch.int32)
            for _ in range(40):
                start = time.perf_counter()
                fill(matcher, bitmask)
                masks.append((time.perf_counter() - start) * 1e6)
                bits = ((bitmask[0, :, None] >> torch.arange(32)) & 1).flatten()[:vocab]
                allowed = bits.nonzero()[:, 0].tolist()
                if not allowed or not consume(matcher, rng.choice(allowed)):
                    break
        return statistics.median(compile_ms), masks

    def row(name: str, compile_ms: float, masks: list[float]) -> str:
        return (f"| {name} | {compile_ms:.1f} | {np.percentile(masks, 50):,.0f} | "
                f"{np.percentile(masks, 99):,.0f} |")

    import llguidance.torch
    from llguidance import LLMatcher, LLTokenizer

    from lathe.serve.reasoning import reasoning_parser
    from lathe.serve.structured import Literals, StructuredOutput
    ll_tokenizer = LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=eos)
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(BENCH_SCHEMA),
                                                 defaults={"whitespace_flexible": False})
    # the same schema after a reasoning block, the reply inside it (as a thinking model's
    # is): masks of the reasoning's free text, which lathe allows before a constraint
    after_reasoning = StructuredOutput(json=json.dumps(BENCH_SCHEMA), prefix=reasoning_parser(
        "qwen3").constraint_prefix(True, Literals.of(tokenizer), eos)).llguidance_grammar()
    rows = [row(name, *walk(
        lambda grammar=grammar: LLMatcher(ll_tokenizer, grammar, log_level=0),
        lambda m, b: llguidance.torch.fill_next_token_bitmask(m, b, 0),
        lambda m, t: m.consume_token(t)))
        for name, grammar in (("llguidance", grammar),
                              ("llguidance, after reasoning", after_reasoning))]
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return rows + ["| xgrammar | not installed (`pip install xgrammar`) | | |"]
    info = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer), vocab_size=vocab,
        stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    rows.append(row("xgrammar", *walk(
        lambda: xgrammar.GrammarMatcher(compiler.compile_json_schema(
            json.dumps(BENCH_SCHEMA), any_whitespace=False)),
        lambda m, b: m.fill_next_token_bitmask(b),
        lambda m, t: m.accept_token(t))))
    return rows


def random_adapters(checkpoint: Path, folder: Path, count: int) -> dict[str, Path]:
    """`count` rank-16 adapters on every projection, seeded, as peft folders."""
    from lathe.model.lora import LoraSection, apply_lora, save_adapter

    section = LoraSection(enabled=True, r=16, alpha=32)
    adapters = {}
    for i in range(count):
        model = apply_lora(load_checkpoint(checkpoint), section)
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if ".lora_" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
        adapters[f"lora{i}"] = save_adapter(model, section, folder / f"lora{i}", checkpoint)
    return adapters


def adapter_section(checkpoint: Path, vocab: int, args: argparse.Namespace) -> list[str]:
    load = random_prompts(64, *PROMPT_TOKENS, vocab, seed=16)

    def spread(count: int) -> Callable[[int], dict]:
        return lambda i: {"model": f"lora{i % count}"} if count else {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="lathe-bench-") as tmp:
        adapters = random_adapters(checkpoint, Path(tmp), 16)
        for compiled in (True, False):
            server, url = start_server(checkpoint, EngineConfig(
                max_loras=16, max_lora_rank=16, compile_decode=compiled), loras=adapters)
            try:
                # warm-up: kernels compiled (Triton autotunes per shape) and every adapter
                # in its slot, so the first timed row is not charged for them
                for count in (0, 16):
                    asyncio.run(load_test(url, load[:32], args.server_tokens, 16,
                                          spread(count)))
                baseline = None
                for count in (0, 1, 4, 16):
                    r = asyncio.run(load_test(url, load, args.server_tokens, 16, spread(count)))
                    baseline = baseline or r["tok_s"]
                    rows.append(f"| {'compiled' if compiled else 'eager'} | "
                                f"{count or 'base alone'} | {r['tok_s']:,.0f} | "
                                f"{r['tok_s'] / baseline:.2f}× | "
                                f"{r['ttft50']:,.0f} / {r['ttft99']:,.0f} |")
                    print(rows[-1], flush=True)
            finally:
                server.should_exit = True
    return [f"### (g) LoRA adapters: concurrency 16, 64 streaming /v1/completions requests, "
            f"prompts of {PROMPT_TOKENS[0]}–{PROMPT_TOKENS[1]} tokens, {args.server_tokens} "
            "output tokens each, spread over "
            "N rank-16 adapters on every projection; decode steps compiled (the default) and "
            "eager (`--enforce-eager`)", "",
            "| decode steps | adapters | output tok/s | vs base | TTFT p50 / p99 (ms) |",
            "|---|---:|---:|---:|---:|", *rows, ""]


def decode_section(checkpoint: Path, prompt: list[int], device: torch.device,
                   args: argparse.Namespace) -> list[str]:
    bandwidth = copy_bandwidth(device)
    eval_ids = val_tokens(args.eval_shards, args.eval_tokens) if args.eval_shards else None
    rows = []
    fp32_bytes = 0
    configs = {"": EngineConfig(), ", compiled": EngineConfig(compile_decode=True),
               f", compiled, {args.decode_steps} passes a step": EngineConfig(
                   compile_decode=True, decode_steps=args.decode_steps)}
    for quantize, dtype in ((None, None), (None, torch.bfloat16), ("int8", None),
                            ("int4", None), ("fp8", None)):
        ppl = ""
        if eval_ids is not None:
            served = load_serving_model(checkpoint, quantize=quantize, dtype=dtype)
            ppl = f"{perplexity(served, eval_ids):.3f}"
        for variant, config in configs.items():
            tok_s, nbytes, weights = decode_speed(checkpoint, quantize, prompt,
                                                  args.decode_tokens, device, config, dtype)
            implied = tok_s * nbytes
            name = weights + variant
            rows.append(f"| {name} | {nbytes / 2**20:.1f} | {tok_s:,.1f} | "
                        f"{implied / 1e9:.2f} | {implied / bandwidth:.1%} | "
                        f"{'—' if config.compile_decode or not ppl else ppl} |")
            print(rows[-1], flush=True)
            if quantize is None and dtype is None:
                fp32_bytes = nbytes
    if device.type == "cpu" and (checkpoint / "tokenizer.json").is_file():
        row = llama_cpp_row(checkpoint, prompt, args.decode_tokens, fp32_bytes, bandwidth)
        if row is not None:
            rows.append(row)
            print(row, flush=True)
    return [f"### (c) Single-stream decode ({args.decode_tokens} tokens); copy bandwidth "
            f"{bandwidth / 1e9:.1f} GB/s" + (f"; perplexity on {len(eval_ids):,} validation "
                                             "tokens" if eval_ids else ""), "",
            "| weights | MiB streamed / token | tok/s | implied GB/s | of copy BW | "
            "perplexity |", "|---|---:|---:|---:|---:|---:|", *rows, ""]


def llama_cpp_row(checkpoint: Path, prompt: list[int], new_tokens: int, nbytes: int,
                  bandwidth: float) -> str | None:
    """llama.cpp (llama-cpp-python, when installed) decoding the f32 GGUF of the same
    weights from the same prompt on the same threads, and how many of its greedy tokens
    match lathe's."""
    try:
        import llama_cpp
    except ImportError:
        print("(c) llama.cpp row skipped: pip install llama-cpp-python (builds from source)")
        return None
    from lathe.serve.gguf_export import export_gguf
    with tempfile.TemporaryDirectory() as folder:
        gguf = export_gguf(checkpoint, Path(folder) / "model.gguf", "f32")
        llm = llama_cpp.Llama(str(gguf), n_ctx=len(prompt) + new_tokens + 8,
                              n_threads=torch.get_num_threads(), n_batch=512, verbose=False)
        tok_s = 0.0
        for _ in range(REPEATS):
            tokens, start = [], 0.0
            for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
                if not tokens:
                    start = time.perf_counter()  # after the prefill and first token, as (c)
                tokens.append(token)
                if len(tokens) == new_tokens:
                    break
            tok_s = max(tok_s, (len(tokens) - 1) / (time.perf_counter() - start))
    engine = LLMEngine.from_checkpoint(checkpoint)
    ours = engine.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0,
                                                    ignore_eos=True))[0].outputs[0].token_ids
    same = next((i for i, (a, b) in enumerate(zip(ours, tokens, strict=False)) if a != b),
                min(len(ours), len(tokens)))
    implied = tok_s * nbytes
    return (f"| llama.cpp {llama_cpp.__version__}, f32 GGUF (first {same}/{new_tokens} greedy "
            f"tokens as lathe's) | {nbytes / 2**20:.1f} | {tok_s:,.1f} | {implied / 1e9:.2f} | "
            f"{implied / bandwidth:.1%} | — |")


def batched_decode_section(checkpoint: Path, device: torch.device,
                           args: argparse.Namespace) -> list[str]:
    rows = []
    max_seq_len = load_checkpoint(checkpoint).config.max_seq_len
    context = min(args.decode_context, max_seq_len - args.decode_tokens)
    for batch in args.decode_batches:
        with_kernel = batched_decode_speed(checkpoint, batch, context, args.decode_tokens,
                                           device)
        with kernels_off("paged_decode"):
            gathered = batched_decode_speed(checkpoint, batch, context, args.decode_tokens,
                                            device)
        rows.append(f"| {batch} | {with_kernel:,.0f} | {gathered:,.0f} | "
                    f"{with_kernel / gathered:.2f}× |")
        print(rows[-1], flush=True)
    return [f"### (d) Batched decode after {context}-token prompts ({args.decode_tokens} "
            "tokens each): Triton paged attention vs gather + SDPA", "",
            "| batch | paged kernel tok/s | gather + SDPA tok/s | speed-up |",
            "|---:|---:|---:|---:|", *rows, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lathe.serve.bench")
    parser.add_argument("--checkpoint", type=Path, help="default: a random-init nano model")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--server-tokens", type=int, default=32)
    parser.add_argument("--server-rounds", type=int, default=5,
                        help="(b): interleaved load rounds per concurrency (medians kept)")
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="(b): also a server of this many engine cores")
    parser.add_argument("--server-weights", choices=list(SERVER_WEIGHTS), default="f32",
                        help="(b): the servers' weights (bf16: lathe's --dtype bfloat16 "
                             "against llama-server's bf16 GGUF; int8: --quantize int8 against "
                             "q8_0)")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=8,
                        help="(a), (c): forward passes per step of the multi-step rows")
    parser.add_argument("--offline-batched-tokens", type=int, default=2048,
                        help="(a): the token budget of the offline-settings row")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16, 64],
                        help="(d), GPU only: concurrent sequences")
    parser.add_argument("--decode-context", type=int, default=1024,
                        help="(d), GPU only: prompt tokens before decoding")
    parser.add_argument("--eval-shards", type=Path, help="token shards with a val split")
    parser.add_argument("--eval-tokens", type=int, default=16384)
    parser.add_argument("--draft", type=Path,
                        help="(e): a draft checkpoint sharing the tokenizer (e.g. the student)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="(e)")
    parser.add_argument("--spec-batches", type=int, nargs="+", default=[1, 8], help="(e)")
    parser.add_argument("--spec-tokens", type=int, default=64, help="(e): new tokens each")
    parser.add_argument("--start-loras", nargs="*", default=[], metavar="NAME=FOLDER",
                        help="(h): adapters every started server loads")
    parser.add_argument("--turns", type=int, default=8, help="(i): requests in the loop")
    parser.add_argument("--turn-context", type=int, default=1024,
                        help="(i): the first prompt's tokens")
    parser.add_argument("--turn-answer", type=int, default=32, help="(i): each answer's tokens")
    parser.add_argument("--turn-tokens", type=int, default=64,
                        help="(i): the tokens each turn adds after the answer")
    parser.add_argument("--sections", default="abcdefghi",
                        help="which sections run, e.g. 'ce' (d needs CUDA, e needs --draft, "
                             "f a --checkpoint with a tokenizer)")
    add_history_arguments(parser)
    print(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
