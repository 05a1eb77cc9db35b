"""`python -m lathe.pretrain.bench`: training throughput (tokens/s) and MFU of lathe's
Transformer beside `transformers.LlamaForCausalLM` of the same shape, trained by the same
loop (AdamW, clipping, next-token loss) on the same random batches, in one process.

On CPU it measures the `tiny` and `nano` presets in fp32, against the measured fp32
matmul peak. On a GPU it adds a ~1B model (the `1b` preset at 2,048 context) in bf16
autocast, with lathe's Triton kernels on and off (`LATHE_KERNELS=0`), then with per-block
torch.compile and with torchao FP8, against the device's bf16 (or FP8) peak; peak memory
shows what the fused kernels save. A mixture of experts (8 experts of half the MLP width, 2 a
token) runs beside the dense model of the same active size, its experts through the grouped
GEMM and through the per-expert loop; MFU counts active parameters.
Results are printed and appended to the history in `--out` (`lathe.core.bench_history`;
`--out docs` from a checkout's root: the project's own).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lathe.core.bench_history import add_history_arguments, history_folder, record
from lathe.kernels import kernels_off
from lathe.model.config import ModelConfig
from lathe.model.transformer import Experts, Transformer
from lathe.pretrain.runtime.converters import compile_blocks, convert_to_fp8, fp8_supported
from lathe.pretrain.runtime.monitor import peak_flops
from lathe.pretrain.train import lm_loss


@dataclass
class Case:
    label: str
    preset: str
    overrides: dict
    batch: int
    seq_len: int
    implementation: str  # "lathe" or "transformers"
    autocast: torch.dtype | None = None
    compile: bool = False
    fp8: bool = False
    kernels: bool = True  # False runs lathe with LATHE_KERNELS=0 (the PyTorch references)
    experts_loop: bool = False  # a mixture of experts through its per-expert loop


def build(case: Case, device: torch.device) -> tuple[nn.Module, ModelConfig]:
    config = ModelConfig.from_preset(case.preset, **case.overrides)
    torch.manual_seed(0)
    if case.implementation == "transformers":
        from transformers import LlamaConfig, LlamaForCausalLM

        hf_config = LlamaConfig(**config.to_hf_config())
        hf_config._attn_implementation = "sdpa"
        model = LlamaForCausalLM(hf_config)
    else:
        model = Transformer(config)
        if case.experts_loop:
            for module in model.modules():
                if isinstance(module, Experts):
                    module.forward = module.forward_loop
        if case.fp8:
            convert_to_fp8(model, emulate=not fp8_supported(device))
        if case.compile:
            compile_blocks(model)
    return model.to(device).train(), config


def train_steps(model: nn.Module, case: Case, config: ModelConfig, device: torch.device,
                steps: int, warmup: int) -> float:
    """Seconds per step, averaged over `steps` after `warmup` untimed steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (case.batch, case.seq_len + 1),
                          generator=generator).to(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=case.autocast, enabled=case.autocast is not None):
            if case.implementation == "transformers":
                loss = model(input_ids=batch, labels=batch).loss
            else:
                loss, _ = lm_loss(model, batch, z_loss=0.0)  # what `lathe pretrain` runs
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# a mixture of experts against the dense model of its active size: 8 experts of half the
# dense MLP's width, 2 a token, so a token's MLP weights match the dense one's
MOE = {"family": "qwen3_moe", "n_experts": 8, "n_experts_per_token": 2}
DENSE = {"family": "qwen3"}


def moe_cases(preset: str, batch: int, seq_len: int, autocast: torch.dtype | None,
              label: str) -> list[Case]:
    width = ModelConfig.from_preset(preset).ffn_hidden_dim // 2
    moe = {**MOE, "moe_ffn_hidden_dim": width}
    return [Case(f"{label}, dense (same active size)", preset, DENSE, batch, seq_len, "lathe",
                 autocast),
            Case(f"{label}, MoE 8 × top-2, grouped GEMM", preset, moe, batch, seq_len, "lathe",
                 autocast),
            Case(f"{label}, MoE 8 × top-2, per-expert loop", preset, moe, batch, seq_len,
                 "lathe", autocast, experts_loop=True)]


def cases(device: torch.device) -> list[Case]:
    if device.type != "cuda":
        return [*(Case(f"{preset} fp32", preset, {}, batch, 256, impl)
                  for preset, batch in (("tiny", 16), ("nano", 8))
                  for impl in ("transformers", "lathe")),
                *moe_cases("tiny", 16, 256, None, "tiny fp32")]
    one_b = {"max_seq_len": 2048}
    bf16 = torch.bfloat16
    return [
        Case("nano bf16", "nano", {}, 32, 512, "transformers", bf16),
        Case("nano bf16", "nano", {}, 32, 512, "lathe", bf16),
        *moe_cases("nano", 32, 512, bf16, "nano bf16"),
        Case("1b bf16", "1b", one_b, 4, 2048, "transformers", bf16),
        Case("1b bf16", "1b", one_b, 4, 2048, "lathe", bf16),
        Case("1b bf16, kernels off", "1b", one_b, 4, 2048, "lathe", bf16, kernels=False),
        Case("1b bf16 + compile", "1b", one_b, 4, 2048, "lathe", bf16, compile=True),
        Case("1b bf16 + compile + FP8", "1b", one_b, 4, 2048, "lathe", bf16, compile=True,
             fp8=True),
    ]


def run(steps: int, warmup: int, out: Path | None, only: list[str] | None = None) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    peaks = {fp8: peak_flops(device, fp8=fp8) for fp8 in (False, True)}  # measured once
    for case in picked(cases(device), only):
        model, config = build(case, device)
        with contextlib.nullcontext() if case.kernels else kernels_off():
            seconds = train_steps(model, case, config, device, steps, warmup)
        tokens_per_s = case.batch * case.seq_len / seconds
        peak = peaks[case.fp8][0]
        mfu = tokens_per_s * config.flops_per_token(case.seq_len) / peak
        memory = (f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f}"
                  if device.type == "cuda" else "—")
        rows.append(f"| {case.label} | {case.implementation} | {config.num_params() / 1e6:,.1f}M "
                    f"| {case.batch}×{case.seq_len} | {tokens_per_s:,.0f} | {100 * mfu:.1f}% "
                    f"| {memory} |")
        print(rows[-1], flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"{platform.machine()}, {torch.get_num_threads()} threads")
    table = "\n".join([
        f"## Pretraining throughput — {datetime.date.today()} — {name}, torch {torch.__version__}",
        "",
        "Command: `python -m lathe.pretrain.bench`",
        "",
        f"Same loop for both implementations: AdamW, clip 1.0, next-token loss, {steps} timed "
        f"steps after {warmup} warmup. MFU against {peaks[False][1]} (FP8 rows: "
        f"{peaks[True][1]}).",
        "",
        "| setting | model | params | batch | tokens/s | MFU | peak GiB |",
        "|---|---|---:|---:|---:|---:|---:|",
        *rows, ""])
    record(table, out)
    return table


def picked(cases: list[Case], only: list[str] | None) -> list[Case]:
    """The cases whose label starts with one of the words of `only` (all of them without it)."""
    return [case for case in cases if not only or case.label.startswith(tuple(only))]


def training_bench_main(prog: str,
                        run: Callable[[int, int, Path | None, list[str] | None], str],
                        steps: int, warmup: int, argv: list[str] | None) -> int:
    """The command line of a training-throughput bench: --steps, --warmup, --only and the
    history's --out / --no-write."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    add_history_arguments(parser)
    parser.add_argument("--only", type=lambda text: text.split(","), default=None,
                        help="only the rows whose label starts with one of these "
                             "comma-separated words, e.g. '1b' (the 1B cases on a GPU)")
    args = parser.parse_args(argv)
    print(run(args.steps, args.warmup, history_folder(args), args.only))
    return 0


def main(argv: list[str] | None = None) -> int:
    return training_bench_main("python -m lathe.pretrain.bench", run, 5, 2, argv)


if __name__ == "__main__":
    raise SystemExit(main())
