"""Which of lathe's kernels run by default on each device, and the measurement behind each
choice. The dispatch reads this table once, when a model or engine is built
(`lathe.kernels.dispatch.configure`); `LATHE_KERNELS*` variables override it.

The rule: a kernel is on by default on a device only where it measured at least as fast
as the best of what it replaces there — eager PyTorch and torch.compile — in the case it
is used for (forward + backward for a training op, forward for an inference op). A tie
that is not a win stays off; a case never measured stays off, with one exception, whose
entry says so: torch's own grouped GEMM for mixtures of experts on CUDA, where what it
replaces waits on the host once a layer and runs a GEMM per expert. On CUDA the kernels are
Triton's; on CPU they are lathe's native C++ ops (`cpu_native`) or, for the quantized
GEMMs, torch's own int8/int4 GEMMs, which take the place of dequantize-then-matmul.
Update an entry only from a new run of its command, and say what it measured.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Default:
    on: bool
    figure: str  # the measured case: the kernel's time against what it replaces
    measured: str  # date, device, software; or "not yet: " and why it is on all the same
    command: str


H200 = "2026-11-26, NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, bf16"
H200_LATE = "2026-11-27, NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, bf16"
H200_NOW = "2026-11-28, NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, bf16"
CPU = "2026-11-25, AMD EPYC (AVX-512), 2 threads, torch 2.13.0+cpu, float32"
CPU_LATE = "2026-11-24 (late), x86_64, 2 threads, torch 2.13.0+cpu, float32"
CPU_NOW = ("2026-11-26, AMD EPYC (AVX-512), 2 threads, torch 2.13.0+cpu, float32, cores "
           "shared with a test run")
BENCH = "python -m lathe.kernels.bench"
PRETRAIN_BENCH = "python -m lathe.pretrain.bench"
QUANT = ("Int8Linear / Int4Linear(2048 -> 8192) forward, median of 30, against "
         "kernels_off('int8_matmul', 'int4_matmul', 'decode_linear')")

DEFAULTS: dict[tuple[str, str], Default] = {
    ("rms_norm", "cuda"): Default(
        True, "16384 x 2048, forward+backward 461 us; torch.compile 485, Liger 471, eager "
        "1,494 (H100: 592 against compile's 770)", H200, BENCH),
    ("grouped_matmul", "cuda"): Default(
        True, "torch._grouped_mm, one grouped GEMM for all experts (bf16, Hopper on), against "
        "a loop whose split sizes are read on the host, one sync a layer, and a GEMM per "
        "expert", "not yet: torchtitan's MoE default on Hopper; the pretrain bench's CUDA "
        "MoE rows time it against the loop", PRETRAIN_BENCH),
    ("add_rms_norm", "cuda"): Default(
        False, "16384 x 2048, forward+backward 598 us; torch.compile 729, eager 1,665 — a "
        "win on the H200, but a loss on the H100 (1,057 against 796): off until a GPU run "
        "with it on passes recipes/gpu-smoke.sh and the pretrain bench", H200, BENCH),
    ("swiglu", "cuda"): Default(
        False, "16384 x 8192, forward+backward 956.0 us; torch.compile 956.0 (a tie), Liger "
        "965.5, eager 1,339 (H100: 1,327.2 against 1,326.7)", H200, BENCH),
    ("rope", "cuda"): Default(
        False, "4 x 2048 tokens, 32/8 heads of 64, forward+backward 590 us; torch.compile "
        "872, Liger 601, eager 720; forward alone 174 against compile's 146 — on the H100 "
        "808 against compile's 328: off until a GPU run with it on passes "
        "recipes/gpu-smoke.sh and the pretrain bench. Measured on the kernel that looped "
        "over 8 rows a program; it now rotates a tile of rows at once, not yet timed on a GPU",
        H200, BENCH),
    ("linear_cross_entropy", "cuda"): Default(
        False, "8192 x 2048 -> 128256, forward+backward 110,698 us; the chunked PyTorch head "
        "(`fused_ce`, what runs instead) 39,781 (2.8 GiB), torch.compile 21,502 (2.5 GiB), "
        "Liger 28,981 (0.6 GiB), eager 31,529 (12.0 GiB)", H200_NOW,
        BENCH + " --only linear_cross_entropy"),
    ("causal_attention", "cuda"): Default(
        False, "4 x 2048 tokens, 32/8 heads of 64, square, forward+backward 1,326 us; SDPA "
        "808, torch.compile 808 (H100: 1,376 against 852) — square attention takes SDPA "
        "whatever this says; the case dispatched here, a chunk after cached context, is not "
        "measured", H200_LATE, BENCH + " --only attention"),
    ("document_attention", "cuda"): Default(
        False, "4 rows of 2048 tokens packed with documents of 1/16 to 1/4 of a row, 32/8 "
        "heads of 64, forward+backward 1,260 us; SDPA under the block-diagonal mask 2,021, "
        "torch.compile 1,917; forward 121 against 642 and 531 — a win, off until a GPU run "
        "with it on passes recipes/gpu-smoke.sh and a packed training run",
        H200_LATE, BENCH + " --only attention"),
    ("int8_matmul", "cuda"): Default(
        True, "32 x 2048 -> 8192, 51.9 us; torch.compile 102.0, eager dequantize + matmul "
        "141.3; 1 row 51.6 against 90.7 and 141.4 (dense bf16, which it does not replace: "
        "17.0)", H200, BENCH),
    ("int4_matmul", "cuda"): Default(
        True, "32 x 2048 -> 8192, 24.7 us; torch.compile 86.3, eager dequantize + matmul "
        "232.3; 1 row 42.9 against 146.0 and 232.4 (dense bf16: 16.8)", H200, BENCH),
    ("paged_decode", "cuda"): Default(
        True, "32 x 2,048 tokens, 51 us; torch.compile 113, gather + SDPA 157; one 32k "
        "sequence 70 against 146 and 294 (H100: 90 against 158 and 181)", H200_LATE,
        BENCH + " --only paged"),
    ("rms_norm", "cpu"): Default(
        True, "1440 tokens of 128, 13.1 us; torch.compile 51.1, eager 56.5", CPU, BENCH),
    ("add_rms_norm", "cpu"): Default(
        True, "1440 tokens of 128, 32.3 us; torch.compile 64.3, eager 91.4", CPU, BENCH),
    ("swiglu", "cpu"): Default(
        True, "1440 x 352, 105.9 us; torch.compile 139.9, eager 145.0", CPU, BENCH),
    ("rope", "cpu"): Default(
        True, "1440 tokens of 128, 4/2 heads of 32, 41.5 us; torch.compile 79.8, eager 214.3",
        CPU, BENCH),
    ("grouped_matmul", "cpu"): Default(
        True, "tiny MoE (8 experts, top-2), 16 x 256 tokens, training step 12,854 tok/s "
        "against the per-expert loop's 12,389",
        "2026-11-26, AMD EPYC (AVX-512), 2 threads, torch 2.13.0+cpu, float32", PRETRAIN_BENCH),
    ("paged_decode", "cpu"): Default(
        True, "16 x 128 tokens, 20.9 us; torch.compile 112.7, gather + SDPA 119.5",
        CPU_LATE, BENCH),
    ("decode_linear", "cpu"): Default(
        True, "1 x 128 -> 4096, 16.8 us against F.linear's 65.1; 64 x 128 -> 4096 421.3 "
        "against 438.8", CPU_LATE, BENCH),
    ("lora_bgmv", "cpu"): Default(
        True, "16 rank-16 slots, 768 -> 2048: 16 rows 65.4 us against torch.compile's 136.4 "
        "(eager 742.2), 64 rows 324.9 against 790.5; 1 row (768 -> 768) 9.1 against 60.1",
        "2026-11-30, Intel Xeon (AVX-512), 2 threads, torch 2.13.0+cpu, float32", BENCH),
    ("argmax", "cpu"): Default(
        True, "1 x 4096, 1.9 us against torch.argmax's 5.1", CPU_LATE, BENCH),
    ("int8_matmul", "cpu"): Default(
        True, "1 row 749 us against 79,531; 32 rows 23,951 against 110,658", CPU_NOW, QUANT),
    ("int4_matmul", "cpu"): Default(
        True, "1 row 458 us against 133,551; 32 rows 31,999 against 177,463", CPU_NOW, QUANT),
}
