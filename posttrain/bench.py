"""`python -m lathe.posttrain.bench`: SFT throughput with and without packing, on the same
model, data and loop in one process — the README run's SFT (its model shape, the embedded
two- and three-digit arithmetic chats, max_len 64, 64 chats a step) and multi-turn chats
whose lengths vary about tenfold (1 to 12 arithmetic turns, max_len 512), as real chat
data does. `--only vocab`: the chunked LM head on a 151,936-token vocabulary against whole
logits. `--only plan`: `lathe plan` against measured peaks. `--only lora`: a LoRA SFT step
(rank 16 on every projection, frozen fp32 base, bf16 autocast on a GPU) of the `1b` shape
on a GPU (`tiny` on CPU) against `transformers` + `peft` on the same shape and batch, each
in its own process: tokens/s and peak memory.

Each mode trains the way `lathe sft` does (`sft_loss`: one forward and backward over the
micro-batch, AdamW, clipping): padded, each chat padded to the longest of its
micro-batch; packed (`data.packing`), chats placed into rows of max_len by best-fit
decreasing, each row as many rows a step as hold the same number of real tokens on
average. Tokens/s counts real tokens only; padding is the share of computed positions
that hold none. On CPU in fp32; on a GPU in bf16 autocast. The model is the README
shape with random weights: throughput does not depend on them.
Results are printed and appended to the history in `--out` (`lathe.core.bench_history`).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import multiprocessing
import platform
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lathe.core.bench_history import record
from lathe.data.chat_encoding import chat_encoder
from lathe.data.formats import Chat, load_chat_dataset
from lathe.data.tasks import task_examples
from lathe.data.tokenizer import save_tokenizer, train_tokenizer
from lathe.model.checkpoint import save_checkpoint
from lathe.model.config import ModelConfig
from lathe.model.lora import LoraSection, apply_lora
from lathe.model.transformer import Transformer
from lathe.posttrain.chats import Example, collate, tokenize
from lathe.posttrain.common import ShuffledBatches
from lathe.posttrain.packing import best_fit_decreasing, collate_packed
from lathe.posttrain.plan_bench import plan_rows
from lathe.posttrain.sft import sft_loss
from lathe.pretrain.bench import synchronize, training_bench_main
from lathe.pretrain.runtime.monitor import PeakMemory


@dataclass
class Dataset:
    label: str
    chats: list[Chat]
    max_len: int
    chats_per_step: int


def multi_turn_chats(count: int, seed: int = 0) -> list[Chat]:
    """Chats of 1 to 12 arithmetic question/answer turns (seeded)."""
    rows = task_examples("arithmetic", "train", None)
    rng = random.Random(seed)
    chats = []
    for i in range(count):
        messages = []
        for row in rng.sample(rows, rng.randint(1, 12)):
            messages += [{"role": "user", "content": row.prompt},
                         {"role": "assistant", "content": row.answer}]
        chats.append(Chat(messages, where=f"multi-turn #{i}"))
    return chats


def readme_checkpoint(folder: Path) -> Path:
    """A random model of the README run's shape (the tiny preset, a 4,096-token BPE trained
    on the arithmetic tasks here) with lathe's chat template."""
    texts = [f"{r.prompt} {r.answer}" for task in ("arithmetic", "arithmetic3")
             for r in task_examples(task, "train", None)]
    save_tokenizer(train_tokenizer(texts, vocab_size=4096, max_digits=1, show_progress=False),
                   folder / "tokenizer")
    config = ModelConfig.from_preset("tiny", vocab_size=4096)
    torch.manual_seed(0)
    return save_checkpoint(Transformer(config), folder / "model", tokenizer=folder / "tokenizer")


def measure(model: Transformer, examples: list[Example], dataset: Dataset, packed: bool,
            device: torch.device, steps: int, warmup: int) -> dict[str, float]:
    """Real tokens per second, padding fraction and rows per step of one mode."""
    items: list = examples
    per_step = dataset.chats_per_step
    if packed:
        items = [[examples[i] for i in row] for row in
                 best_fit_decreasing([len(e.ids) for e in examples], dataset.max_len)]
        per_step = max(1, round(dataset.chats_per_step * len(items) / len(examples)))
    batches = ShuffledBatches(items, per_step, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    autocast = torch.bfloat16 if device.type == "cuda" else None
    tokens = slots = 0
    seconds = 0.0
    for step in range(warmup + steps):
        rows = batches.next()
        batch = (collate_packed(rows, 0, device) if packed else collate(rows, 0, device))
        synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            loss, _ = sft_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= warmup:
            seconds += time.perf_counter() - start
            tokens += sum(batch["lengths"])
            slots += batch["ids"].numel()
    return {"tokens_per_s": tokens / seconds, "padding": 1 - tokens / slots,
            "rows": per_step, "width": slots / steps / per_step}


# a Qwen3-vocabulary model of two layers: the head is most of the step (the case)
VOCAB_MODEL = {"family": "qwen3", "vocab_size": 151_936, "n_layers": 2, "max_seq_len": 2048}
VOCAB_MODES = ("no loss", "chunked", "whole logits")


def timed_steps(loss: Callable[[], Tensor], parameters: list[Tensor], device: torch.device,
                steps: int, warmup: int) -> float:
    """Seconds of `steps` AdamW steps on `loss()` after `warmup` untimed ones, under bf16
    autocast on a GPU."""
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, fused=device.type == "cuda")
    autocast = torch.bfloat16 if device.type == "cuda" else None
    seconds = 0.0
    for step in range(warmup + steps):
        synchronize(device)
        began = time.perf_counter()
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            value = loss()
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= warmup:
            seconds += time.perf_counter() - began
    return seconds


def vocab_step(mode: str, rows: int, seq_len: int, steps: int, warmup: int) -> dict[str, float]:
    """One mode's SFT steps (AdamW) on the VOCAB_MODEL, in a fresh process: peak memory over
    the process's before the model (CPU: RSS; CUDA: allocated) and tokens/s."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    memory = PeakMemory(device)
    memory.start()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("nano", **VOCAB_MODEL)).to(device).train()
    model.chunked_head = mode != "whole logits"
    ids = torch.randint(0, VOCAB_MODEL["vocab_size"], (rows, seq_len), device=device)
    batch = {"ids": ids, "labels": ids}

    def loss() -> Tensor:
        if mode == "no loss":
            return model(ids, head=False).hidden.float().square().mean()
        return sft_loss(model, batch)[0]

    seconds = timed_steps(loss, list(model.parameters()), device, steps, warmup)
    return {"peak_gib": memory.peak() / 2**30,
            "tokens_per_s": rows * seq_len * steps / seconds}


def vocab_rows(steps: int, warmup: int, rows: int = 4, seq_len: int = 2048) -> list[str]:
    """The large-vocabulary rows: each mode in its own process, so that peaks do not mix."""
    results = {mode: in_own_process(vocab_step, mode, rows, seq_len, steps, warmup)
               for mode in VOCAB_MODES}
    base = results["no loss"]["peak_gib"]
    reference = results["whole logits"]["tokens_per_s"]
    lines = [f"| {mode} | {r['peak_gib']:.2f} | "
             f"{r['peak_gib'] / base:.2f}× | {r['tokens_per_s']:,.0f} | "
             f"{r['tokens_per_s'] / reference:.2f}× |" for mode, r in results.items()]
    for line in lines:
        print(line, flush=True)
    return lines


def in_own_process(function: Callable[..., dict[str, float]], *args: Any) -> dict[str, float]:
    """`function(*args)` in a fresh (spawned) process, so that its peak memory is its own."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(function, *args).result()


LORA_IMPLEMENTATIONS = ("lathe", "transformers + peft")


def lora_step(implementation: str, preset: str, rows: int, seq_len: int, steps: int,
              warmup: int) -> dict[str, float]:
    """LoRA SFT steps (rank 16 on every projection, the base frozen in fp32) of `preset` in
    lathe or in transformers' Llama with peft's adapters, in a fresh process: peak memory
    over the process's before the model and tokens/s."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    memory = PeakMemory(device)
    memory.start()
    config = ModelConfig.from_preset(preset, max_seq_len=seq_len)
    section = LoraSection(enabled=True)
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (rows, seq_len), device=device)
    if implementation == "lathe":
        model = apply_lora(Transformer(config), section).to(device).train()
        batch = {"ids": ids, "labels": ids}

        def loss() -> Tensor:
            return sft_loss(model, batch)[0]
    else:
        from peft import get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        hf_config = LlamaConfig(**config.to_hf_config())
        hf_config._attn_implementation = "sdpa"
        model = get_peft_model(LlamaForCausalLM(hf_config), section.peft_config())
        model = model.to(device).train()

        def loss() -> Tensor:
            return model(input_ids=ids, labels=ids).loss
    trainable = [p for p in model.parameters() if p.requires_grad]
    seconds = timed_steps(loss, trainable, device, steps, warmup)
    return {"peak_gib": memory.peak() / 2**30,
            "tokens_per_s": rows * seq_len * steps / seconds,
            "trainable_m": sum(p.numel() for p in trainable) / 1e6}


def lora_table(steps: int, warmup: int, out: Path | None) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset, rows, seq_len = ("1b", 4, 2048) if device.type == "cuda" else ("tiny", 4, 256)
    results = {name: in_own_process(lora_step, name, preset, rows, seq_len, steps, warmup)
               for name in LORA_IMPLEMENTATIONS}
    reference = results["transformers + peft"]
    lines = [f"| {name} | {r['trainable_m']:.1f}M | {r['tokens_per_s']:,.0f} | "
             f"{r['tokens_per_s'] / reference['tokens_per_s']:.2f}× | {r['peak_gib']:.2f} |"
             for name, r in results.items()]
    for line in lines:
        print(line, flush=True)
    precision = "bf16 autocast" if device.type == "cuda" else "fp32"
    table = "\n".join([
        f"## LoRA SFT step — {datetime.date.today()} — {device_name(device)}, "
        f"torch {torch.__version__}, {precision}",
        "",
        f"Command: `python -m lathe.posttrain.bench --only lora --steps {steps} --warmup "
        f"{warmup}`",
        "",
        f"The `{preset}` shape, {rows} × {seq_len} tokens, rank 16 (alpha 32) on every "
        "projection, the base frozen in fp32, AdamW on the adapters; lathe's `sft_loss` "
        "(chunked head) against `LlamaForCausalLM` (SDPA) under `peft.get_peft_model` with "
        "the same LoraConfig; each in its own process. Peak: "
        + ("`torch.cuda.max_memory_allocated`." if device.type == "cuda" else
           "the process's peak RSS above its size before the model."),
        "",
        "| implementation | trainable | tokens/s | ÷ transformers + peft | peak GiB |",
        "|---|---:|---:|---:|---:|",
        *lines, ""])
    record(table, out)
    return table


def run(steps: int, warmup: int, out: Path | None, only: list[str] | None = None) -> str:
    if only == ["vocab"]:
        return vocab_table(steps, warmup, out)
    if only == ["plan"]:
        return plan_table(out)
    if only == ["lora"]:
        return lora_table(steps, warmup, out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = readme_checkpoint(Path(tmp))
        encoder = chat_encoder(checkpoint)
        datasets = [
            Dataset("README SFT (arithmetic + arithmetic3)",
                    load_chat_dataset("task:arithmetic+arithmetic3", "train", 8192), 64, 64),
            Dataset("multi-turn chats (1-12 turns)", multi_turn_chats(2048), 512, 16),
        ]
        rows = []
        for dataset in datasets:
            if only and not dataset.label.startswith(tuple(only)):
                continue
            examples = tokenize(encoder, dataset.chats, dataset.max_len)
            lengths = [len(e.ids) for e in examples]
            results = {}
            for packed in (False, True):
                torch.manual_seed(0)
                model = Transformer(ModelConfig.from_preset("tiny", vocab_size=4096))
                model = model.to(device).train()
                results[packed] = measure(model, examples, dataset, packed, device, steps,
                                          warmup)
                r = results[packed]
                rows.append(f"| {dataset.label} | {min(lengths)}–{max(lengths)} | "
                            f"{'packed' if packed else 'padded'} | {r['rows']} × "
                            f"{r['width']:.0f} | {r['padding']:.1%} | "
                            f"{r['tokens_per_s']:,.0f} |")
                print(rows[-1], flush=True)
            speedup = results[True]["tokens_per_s"] / results[False]["tokens_per_s"]
            rows.append(f"| {dataset.label} | | packed ÷ padded | | | {speedup:.2f}× |")
            print(rows[-1], flush=True)
    name = device_name(device)
    precision = "bf16 autocast" if device.type == "cuda" else "fp32"
    table = "\n".join([
        f"## SFT packing — {datetime.date.today()} — {name}, torch {torch.__version__}, "
        f"{precision}",
        "",
        "Command: `python -m lathe.posttrain.bench`",
        "",
        f"The README model's shape (tiny preset, 4,096 vocabulary), `sft_loss` + AdamW + clip, "
        f"{steps} timed steps after {warmup} warm-up. Rows × width: the micro-batch's shape "
        "(mean width). Tokens/s counts real tokens.",
        "",
        "| data | tokens per chat | mode | rows × width | padding | tokens/s |",
        "|---|---|---|---:|---:|---:|",
        *rows, ""])
    record(table, out)
    return table


def vocab_table(steps: int, warmup: int, out: Path | None) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines = vocab_rows(steps, warmup)
    table = "\n".join([
        f"## SFT step on a 151,936-token vocabulary — {datetime.date.today()} — "
        f"{device_name(device)}, torch {torch.__version__}",
        "",
        f"Command: `python -m lathe.posttrain.bench --only vocab --steps {steps} --warmup "
        f"{warmup}`",
        "",
        "Qwen3 shape, nano width (dim 384), 2 layers, 4 × 2,048 tokens, AdamW. Modes: no "
        "loss (the final hidden states' mean square, no head); chunked (`sft_loss` as lathe "
        "runs it); whole logits (`sft_loss` with the head's (tokens × vocab) logits made "
        "whole, as before the chunked head). Peak: "
        + ("`torch.cuda.max_memory_allocated`." if device.type == "cuda" else
           "the process's peak RSS above its size before the model."),
        "",
        "| mode | peak GiB | ÷ no loss | tokens/s | ÷ whole logits |",
        "|---|---:|---:|---:|---:|",
        *lines, ""])
    record(table, out)
    return table


def plan_table(out: Path | None) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        rows = plan_rows(Path(tmp))
    table = "\n".join([
        f"## Memory plans against measured peaks — {datetime.date.today()} — "
        f"{device_name(device)}, torch {torch.__version__}",
        "",
        "Command: `python -m lathe.posttrain.bench --only plan`",
        "",
        "`lathe sft`, 3 steps, of a random 60M-parameter model (dim 768, 8 layers, 4,096 "
        "vocabulary) on arithmetic chats packed into 2 rows of 512 tokens, fp32; LoRA r=16 on "
        "every linear. Plan: the start banner's (`lathe plan`'s) per-rank peak. Measured: the "
        "largest rank's "
        + ("`torch.cuda.max_memory_allocated`." if device.type == "cuda" else
           "peak resident set above its size before the model loaded "
           "(MALLOC_MMAP_THRESHOLD_=131072)."),
        "",
        "| configuration | plan GiB | measured GiB | plan ÷ measured |",
        "|---|---:|---:|---:|",
        *rows, ""])
    record(table, out)
    return table


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"{platform.machine()}, {torch.get_num_threads()} threads")


def main(argv: list[str] | None = None) -> int:
    return training_bench_main("python -m lathe.posttrain.bench", run, 20, 3, argv)


if __name__ == "__main__":
    raise SystemExit(main())
