"""`python -m lathe.kernels.bench`: each Triton kernel against its PyTorch reference,
`torch.compile` of that reference, and Liger's kernel where Liger has one (when
`liger-kernel` is installed) — forward and forward+backward time, the forward's achieved
GB/s (memory-bound kernels) or TFLOP/s (matmul-bound ones), and peak memory above the
inputs. Without a CUDA GPU it times the native CPU kernels (paged decode attention, the
few-row float32 and int8 linears, the bf16 linear from a decode step's rows to a prefill's,
the greedy pick, the element-wise layers of a prefill) against their references instead.
The table is printed and appended to the history in `--out` (`lathe.core.bench_history`;
`--no-write` only prints it; `--out docs` from a checkout's root: the project's own).
"""

from __future__ import annotations

import argparse
import datetime
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from lathe.core.bench_history import add_history_arguments, history_folder, record
from lathe.kernels.argmax import argmax_cpu
from lathe.kernels.attention import causal_attention_reference, document_starts
from lathe.kernels.attention_triton import causal_attention_triton
from lathe.kernels.cpu_native import load_cpu_kernels
from lathe.kernels.decode_linear import (
    MAX_ROWS,
    decode_linear_cpu,
    decode_linear_int8_cpu,
    decode_linear_reference,
)
from lathe.kernels.fused_ce import linear_cross_entropy, linear_cross_entropy_reference
from lathe.kernels.fused_ce_triton import linear_cross_entropy_triton
from lathe.kernels.lora_bgmv import lora_bgmv_cpu, lora_bgmv_reference
from lathe.kernels.lora_bgmv_triton import lora_bgmv_triton
from lathe.kernels.paged_attention import paged_decode_cpu, paged_decode_reference
from lathe.kernels.paged_attention_triton import paged_decode_triton
from lathe.kernels.quant_matmul import (
    dequantize_int4,
    dequantize_int8,
    int4_matmul_reference,
    int8_matmul_reference,
)
from lathe.kernels.quant_matmul_triton import int4_matmul_triton, int8_matmul_triton
from lathe.kernels.rmsnorm import (
    add_rms_norm_cpu,
    add_rms_norm_reference,
    rms_norm_cpu,
    rms_norm_reference,
)
from lathe.kernels.rmsnorm_triton import add_rms_norm_triton, rms_norm_triton
from lathe.kernels.rope import rope_cpu, rope_reference
from lathe.kernels.rope_triton import rope_triton
from lathe.kernels.swiglu import swiglu_cpu, swiglu_reference
from lathe.kernels.swiglu_triton import swiglu_triton


@dataclass
class Sizes:
    """Llama-3-1B-like shapes by default: 8 × 2,048 tokens of width 2,048."""

    rows: int = 8 * 2048
    dim: int = 2048
    hidden: int = 8192
    vocab: int = 128256
    ce_rows: int = 8192
    batch: int = 4
    seq: int = 2048
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    decode_batch: int = 32
    context: int = 2048
    long_context: int = 32768
    block_size: int = 16
    int4_group: int = 128


@dataclass(frozen=True)
class PagedShape:
    """One decode-attention step: `batch` sequences of `context` tokens."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int

    def __str__(self) -> str:
        return (f"{self.batch} × {self.context} tokens, {self.heads} / {self.kv_heads} heads "
                f"of {self.head_dim}")


# Off CUDA: the README model's attention (4 query / 2 KV heads of 32) at the decode batch
# sizes its engine compiles, and a Llama-3-1B layer's (32 / 8 of 64) at a longer context
CPU_PAGED_SHAPES = [PagedShape(1, 4, 2, 32, 128), PagedShape(16, 4, 2, 32, 128),
                    PagedShape(64, 4, 2, 32, 128), PagedShape(1, 32, 8, 64, 1024),
                    PagedShape(16, 32, 8, 64, 1024)]


@dataclass
class Case:
    name: str
    # "GB/s" (work = bytes the forward must move), or "TFLOP/s" on a GPU and "GFLOP/s" on
    # the CPU (work = flops)
    unit: str
    work: float
    impls: dict[str, Callable[[], Tensor | tuple[Tensor, ...]]] = field(default_factory=dict)
    backward: bool = True


def _leaf(*shape: int, device: str, dtype: torch.dtype, grad: bool = True) -> Tensor:
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)


def _norm_cases(s: Sizes, device: str, dtype: torch.dtype, compile: bool) -> list[Case]:
    x = _leaf(s.rows, s.dim, device=device, dtype=dtype)
    r = _leaf(s.rows, s.dim, device=device, dtype=dtype)
    w = torch.ones(s.dim, device=device, dtype=dtype, requires_grad=True)
    g = _leaf(s.rows, s.hidden, device=device, dtype=dtype)
    u = _leaf(s.rows, s.hidden, device=device, dtype=dtype)
    size = x.element_size()
    norm = Case("rms_norm", "GB/s", 2 * x.numel() * size, {
        "triton": lambda: rms_norm_triton(x, w, 1e-5),
        "torch": lambda: rms_norm_reference(x, w, 1e-5)})
    add_norm = Case("add_rms_norm", "GB/s", 4 * x.numel() * size, {
        "triton": lambda: add_rms_norm_triton(x, r, w, 1e-5),
        "torch": lambda: add_rms_norm_reference(x, r, w, 1e-5)})
    act = Case("swiglu", "GB/s", 3 * g.numel() * size, {
        "triton": lambda: swiglu_triton(g, u),
        "torch": lambda: swiglu_reference(g, u)})
    if compile:
        compiled_norm, compiled_add, compiled_act = (
            torch.compile(f) for f in (rms_norm_reference, add_rms_norm_reference,
                                       swiglu_reference))
        norm.impls["torch.compile"] = lambda: compiled_norm(x, w, 1e-5)
        add_norm.impls["torch.compile"] = lambda: compiled_add(x, r, w, 1e-5)
        act.impls["torch.compile"] = lambda: compiled_act(g, u)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        norm.impls["liger"] = lambda: LigerRMSNormFunction.apply(x, w, 1e-5)
        act.impls["liger"] = lambda: LigerSiLUMulFunction.apply(g, u)
    except ImportError:
        pass
    return [norm, add_norm, act]


def _rope_case(s: Sizes, device: str, dtype: torch.dtype, compile: bool) -> Case:
    q = _leaf(s.batch, s.heads, s.seq, s.head_dim, device=device, dtype=dtype)
    k = _leaf(s.batch, s.kv_heads, s.seq, s.head_dim, device=device, dtype=dtype)
    angles = torch.rand(s.batch, s.seq, s.head_dim // 2, device=device) * 6.28
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    case = Case("rope", "GB/s", 2 * (q.numel() + k.numel()) * q.element_size(), {
        "triton": lambda: rope_triton(q, k, cos, sin),
        "torch": lambda: rope_reference(q, k, cos, sin)})
    if compile:
        compiled = torch.compile(rope_reference)
        case.impls["torch.compile"] = lambda: compiled(q, k, cos, sin)
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
        case.impls["liger"] = lambda: LigerRopeFunction.apply(q, k, cos, sin)
    except ImportError:
        pass
    return case


def _cross_entropy_case(s: Sizes, device: str, dtype: torch.dtype, compile: bool) -> Case:
    hidden = _leaf(s.ce_rows, s.dim, device=device, dtype=dtype)
    weight = (0.02 * torch.randn(s.vocab, s.dim, device=device)).to(dtype).requires_grad_()
    labels = torch.randint(0, s.vocab, (s.ce_rows,), device=device)
    case = Case("linear_cross_entropy", "TFLOP/s", 2 * s.ce_rows * s.dim * s.vocab, {
        "triton": lambda: linear_cross_entropy_triton(hidden, weight, labels, -100),
        "chunked": lambda: linear_cross_entropy(hidden, weight, labels, -100)[0],
        "torch": lambda: linear_cross_entropy_reference(hidden, weight, labels, -100)})
    if compile:
        compiled = torch.compile(linear_cross_entropy_reference)
        case.impls["torch.compile"] = lambda: compiled(hidden, weight, labels, -100)
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )
        case.impls["liger"] = lambda: LigerFusedLinearCrossEntropyFunction.apply(
            hidden, weight, labels)[0]
    except ImportError:
        pass
    return case


def _quant_cases(s: Sizes, device: str, dtype: torch.dtype, compile: bool) -> list[Case]:
    """Decode-sized GEMMs (1 and decode_batch rows) against the engine's packed weights, and
    the same weights dense in `dtype`: the bandwidth weight-only quantization is meant to
    save."""
    q8 = torch.randint(-127, 128, (s.hidden, s.dim), device=device, dtype=torch.int8)
    scale8 = torch.rand(s.hidden, device=device) / 127
    packed = torch.randint(0, 256, (s.hidden, s.dim // 2), device=device, dtype=torch.uint8)
    groups = s.dim // s.int4_group
    scale4 = torch.rand(s.hidden, groups, device=device) / 15
    minimum = -torch.rand(s.hidden, groups, device=device)
    dense8, dense4 = dequantize_int8(q8, scale8, dtype), dequantize_int4(packed, scale4,
                                                                          minimum, dtype)
    dense = f"dense {str(dtype).removeprefix('torch.')}"
    if compile:
        c8, c4 = torch.compile(int8_matmul_reference), torch.compile(int4_matmul_reference)
    result = []
    for rows in (1, s.decode_batch):
        x = torch.randn(rows, s.dim, device=device, dtype=dtype)
        int8 = Case(f"int8_matmul, {rows} × {s.dim} → {s.hidden}", "GB/s",
                    q8.numel() + 4 * scale8.numel(), {
                        "triton": lambda x=x: int8_matmul_triton(x, q8, scale8),
                        "torch": lambda x=x: int8_matmul_reference(x, q8, scale8),
                        dense: lambda x=x: F.linear(x, dense8)}, backward=False)
        int4 = Case(f"int4_matmul, {rows} × {s.dim} → {s.hidden}", "GB/s",
                    packed.numel() + 8 * scale4.numel(), {
                        "triton": lambda x=x: int4_matmul_triton(x, packed, scale4, minimum),
                        "torch": lambda x=x: int4_matmul_reference(x, packed, scale4, minimum),
                        dense: lambda x=x: F.linear(x, dense4)}, backward=False)
        if compile:
            int8.impls["torch.compile"] = lambda x=x: c8(x, q8, scale8)
            int4.impls["torch.compile"] = lambda x=x: c4(x, packed, scale4, minimum)
        result += [int8, int4]
    return result


def _lora_inputs(rows: int, slots: int, in_features: int, out_features: int, device: str,
                 dtype: torch.dtype) -> tuple[tuple[Tensor, ...], int]:
    """`lora_bgmv`'s arguments for rank-16 adapters in `slots` slots, each row on a random
    slot, and the bytes of the A and B of the slots the rows name."""
    g = torch.Generator().manual_seed(rows)
    args = (torch.randn(rows, out_features, generator=g).to(device, dtype),
            torch.randn(rows, in_features, generator=g).to(device, dtype),
            (torch.randn(slots, in_features, 16, generator=g) * 0.02).to(device, dtype),
            (torch.randn(slots, 16, out_features, generator=g) * 0.02).to(device, dtype),
            torch.ones(slots, device=device),
            torch.randint(0, slots, (rows,), generator=g).to(device))
    named = args[5].unique().numel()
    return args, named * (args[2][0].numel() + args[3][0].numel()) * args[2].element_size()


def _lora_cases(s: Sizes, device: str, dtype: torch.dtype, compile: bool) -> list[Case]:
    """Each row's own rank-16 adapter of 16 slots on the up projection (`lora_bgmv`), at one
    row and at a decode batch: GB/s of the A and B of the slots the rows name."""
    if compile:
        compiled = torch.compile(lora_bgmv_reference, dynamic=False)
    result = []
    for rows in (1, s.decode_batch):
        args, work = _lora_inputs(rows, 16, s.dim, s.hidden, device, dtype)
        case = Case(f"lora_bgmv, {rows} rows × 16 slots, {s.dim} → {s.hidden}", "GB/s", work, {
            "triton": lambda a=args: lora_bgmv_triton(*a),
            "torch": lambda a=args: lora_bgmv_reference(*a)}, backward=False)
        if compile:
            case.impls["torch.compile"] = lambda a=args: compiled(*a)
        result.append(case)
    return result


def _paged_inputs(shape: PagedShape, block_size: int, device: str,
                  dtype: torch.dtype) -> tuple[tuple, int]:
    """Decode-attention arguments for `shape`, each sequence's blocks scattered over the
    pool, and the K/V bytes a step must read."""
    batch, context = shape.batch, shape.context
    blocks = (context + block_size - 1) // block_size
    pool = batch * blocks + 1
    k_slab = torch.randn(pool * block_size, shape.kv_heads, shape.head_dim, device=device,
                         dtype=dtype)
    v_slab = torch.randn_like(k_slab)
    tables = torch.randperm(pool, device=device)[:batch * blocks].view(batch, blocks)
    lens = torch.full((batch,), context, device=device)
    q = torch.randn(batch, shape.heads, shape.head_dim, device=device, dtype=dtype)
    kv_bytes = 2 * batch * context * shape.kv_heads * shape.head_dim * k_slab.element_size()
    return (q, k_slab, v_slab, tables, lens, block_size), kv_bytes


def _paged_case(name: str, batch: int, context: int, s: Sizes, device: str,
                dtype: torch.dtype, compile: bool) -> Case:
    """`batch` sequences of `context` tokens whose blocks are scattered over the pool."""
    args, kv_bytes = _paged_inputs(PagedShape(batch, s.heads, s.kv_heads, s.head_dim, context),
                                   s.block_size, device, dtype)
    whole = args[3].shape[1] * s.block_size
    case = Case(name, "GB/s", kv_bytes, {
        "triton": lambda: paged_decode_triton(*args),
        "triton, no split-KV": lambda: paged_decode_triton(*args, partition_size=whole),
        "torch (gather + SDPA)": lambda: paged_decode_reference(*args)}, backward=False)
    if compile:
        compiled = torch.compile(paged_decode_reference)
        case.impls["torch.compile"] = lambda: compiled(*args)
    return case


def _attention_case(s: Sizes, device: str, dtype: torch.dtype, compile: bool) -> Case:
    q = _leaf(s.batch, s.heads, s.seq, s.head_dim, device=device, dtype=dtype)
    k = _leaf(s.batch, s.kv_heads, s.seq, s.head_dim, device=device, dtype=dtype)
    v = _leaf(s.batch, s.kv_heads, s.seq, s.head_dim, device=device, dtype=dtype)
    flops = 4 * s.batch * s.heads * s.seq * s.seq * s.head_dim / 2  # causal: half the scores
    case = Case("causal_attention", "TFLOP/s", flops, {
        "triton": lambda: causal_attention_triton(q, k, v),
        "torch (SDPA)": lambda: causal_attention_reference(q, k, v)})
    if compile:
        compiled = torch.compile(causal_attention_reference)
        case.impls["torch.compile"] = lambda: compiled(q, k, v)
    return case


def _document_attention_case(s: Sizes, device: str, dtype: torch.dtype, compile: bool) -> Case:
    """Packed rows: each row split into documents of 1/16 to 1/4 of it (seeded); the
    useful work is each document's own causal attention."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(s.batch):
        lengths: list[int] = []
        while sum(lengths) < s.seq:
            lengths.append(min(int(torch.randint(s.seq // 16 + 1, s.seq // 4 + 2, (1,),
                                                 generator=generator)), s.seq - sum(lengths)))
        rows.append(lengths)
    documents = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
                             for lengths in rows]).to(device)
    starts = document_starts(documents)
    q = _leaf(s.batch, s.heads, s.seq, s.head_dim, device=device, dtype=dtype)
    k = _leaf(s.batch, s.kv_heads, s.seq, s.head_dim, device=device, dtype=dtype)
    v = _leaf(s.batch, s.kv_heads, s.seq, s.head_dim, device=device, dtype=dtype)
    flops = sum(4 * s.heads * n * n * s.head_dim / 2 for lengths in rows for n in lengths)
    case = Case("causal_attention, packed documents", "TFLOP/s", flops, {
        "triton": lambda: causal_attention_triton(q, k, v, starts),
        "torch (SDPA, block-diagonal mask)": lambda: causal_attention_reference(
            q, k, v, document_starts=starts)})
    if compile:
        compiled = torch.compile(causal_attention_reference)
        case.impls["torch.compile"] = lambda: compiled(q, k, v, document_starts=starts)
    return case


def cases(sizes: Sizes, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
          compile: bool = True, only: list[str] | None = None) -> list[Case]:
    """Every kernel's case at `sizes` (or those whose name contains a word of `only`); every
    implementation in a case computes the same."""
    every = [
        *_norm_cases(sizes, device, dtype, compile),
        _rope_case(sizes, device, dtype, compile),
        _cross_entropy_case(sizes, device, dtype, compile),
        *_quant_cases(sizes, device, dtype, compile),
        *_lora_cases(sizes, device, dtype, compile),
        _attention_case(sizes, device, dtype, compile),
        _document_attention_case(sizes, device, dtype, compile),
        _paged_case("paged_decode", sizes.decode_batch, sizes.context, sizes, device, dtype,
                    compile),
        _paged_case("paged_decode, one long sequence", 1, sizes.long_context, sizes, device,
                    dtype, compile),
    ]
    return picked(every, only)


def picked(cases: list[Case], only: list[str] | None) -> list[Case]:
    """The cases whose name contains one of the words of `only` (all of them without it)."""
    return [case for case in cases if not only or any(word in case.name for word in only)]


def _outputs(result: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def _step(fn: Callable, backward: bool) -> Callable[[], None]:
    def step() -> None:
        outs = _outputs(fn())
        if backward:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return step


def measure(fn: Callable, backward: bool) -> tuple[float, float | None, float]:
    """(forward ms, forward+backward ms or None, peak MiB above what was allocated before)."""
    from triton.testing import do_bench

    forward = do_bench(_step(fn, False))
    both = do_bench(_step(fn, True)) if backward else None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _step(fn, backward)()
    torch.cuda.synchronize()
    return forward, both, (torch.cuda.max_memory_allocated() - before) / 2**20


def run(sizes: Sizes, out: Path | None, only: list[str] | None = None) -> str:
    lines = []
    for case in cases(sizes, only=only):
        for impl, fn in case.impls.items():
            try:
                forward, both, peak = measure(fn, case.backward)
            except Exception as error:  # a third-party kernel whose API moved: report it
                lines.append(f"| {case.name} | {impl} | failed: {type(error).__name__} "
                             "| | | |")
                print(lines[-1], error, flush=True)
                continue
            scale = 1e9 if case.unit == "GB/s" else 1e12
            rate = case.work / (forward * 1e-3) / scale
            both_text = f"{both * 1e3:,.1f}" if both is not None else "—"
            lines.append(f"| {case.name} | {impl} | {forward * 1e3:,.1f} | "
                         f"{rate:,.{0 if case.unit == 'GB/s' else 1}f} {case.unit} | "
                         f"{both_text} | {peak:,.0f} |")
            print(lines[-1], flush=True)
    table = "\n".join([
        f"## Kernels — {datetime.date.today()} — {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}", "",
        f"Command: `python -m lathe.kernels.bench`, bf16 — norms {sizes.rows} × {sizes.dim}, "
        f"SwiGLU {sizes.rows} × {sizes.hidden}; RoPE and attention {sizes.batch} × "
        f"{sizes.seq} tokens, {sizes.heads} heads / {sizes.kv_heads} KV heads of "
        f"{sizes.head_dim}; fused CE {sizes.ce_rows} × {sizes.dim} → {sizes.vocab}; "
        f"quantized GEMMs 1 and {sizes.decode_batch} rows; paged decode "
        f"{sizes.decode_batch} × {sizes.context} and 1 × {sizes.long_context} tokens.", "",
        "| kernel | implementation | forward µs | forward rate | forward+backward µs "
        "| peak MiB |",
        "|---|---|---:|---:|---:|---:|", *lines, ""])
    record(table, out)
    return table


def cpu_paged_cases(shapes: list[PagedShape], compile: bool = True,
              block_size: int = 16) -> list[Case]:
    """The native CPU paged-decode kernel against its reference (and `torch.compile` of it)
    at each of `shapes`, fp32."""
    result = []
    for shape in shapes:
        args, kv_bytes = _paged_inputs(shape, block_size, "cpu", torch.float32)
        case = Case(f"paged_decode, {shape}", "GB/s", kv_bytes, {
            "native C++": lambda args=args: paged_decode_cpu(*args),
            "torch (gather + SDPA)": lambda args=args: paged_decode_reference(*args)},
            backward=False)
        if compile:
            compiled = torch.compile(paged_decode_reference, dynamic=False)
            case.impls["torch.compile"] = lambda args=args, fn=compiled: fn(*args)
        result.append(case)
    return result


# (rows, in_features, out_features): the README model's layers and LM head at the decode
# buckets the native linear serves, and a Llama-3-1B MLP projection
CPU_LINEAR_SHAPES = [(1, 128, 128), (1, 128, 352), (1, 352, 128), (1, 128, 4096),
                     (4, 128, 4096), (8, 128, 4096), (16, 128, 352), (16, 128, 4096),
                     (32, 128, 352), (32, 128, 4096), (64, 128, 4096), (1, 2048, 8192)]


def cpu_linear_cases(shapes: list[tuple[int, int, int]]) -> list[Case]:
    """The native few-row linear against `F.linear` (BLAS), fp32: GB/s of weight read."""
    result = []
    for rows, in_features, out_features in shapes:
        x = torch.randn(rows, in_features)
        weight = torch.randn(out_features, in_features)
        result.append(Case(
            f"decode_linear, {rows} × {in_features} → {out_features}", "GB/s",
            weight.numel() * weight.element_size(), {
                "native C++": lambda x=x, w=weight: decode_linear_cpu(x, [w]),
                "torch (F.linear, BLAS)": lambda x=x, w=weight: decode_linear_reference(x, [w])},
            backward=False))
    return result


def cpu_int8_linear_cases(shapes: list[tuple[int, int, int]]) -> list[Case]:
    """The native few-row int8 linear against torch's int8 GEMM (`_weight_int8pack_mm`,
    which takes bf16 rows: the casts are timed with it, as a float32 model pays them):
    GB/s of int8 weight read."""
    result = []
    for rows, in_features, out_features in shapes:
        x = torch.randn(rows, in_features)
        q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
        scale = torch.rand(out_features) / 127
        result.append(Case(
            f"decode_linear_int8, {rows} × {in_features} → {out_features}", "GB/s", q.numel(), {
                "native C++": lambda x=x, q=q, s=scale: decode_linear_int8_cpu(x, [(q, s)]),
                "torch (_weight_int8pack_mm, bf16 rows)": lambda x=x, q=q, s=scale:
                    torch.ops.aten._weight_int8pack_mm(x.bfloat16(), q, s.bfloat16()).float()},
            backward=False))
    return result


# (rows, in, out): the 88M model's gate projection at a decode step, a decode batch, a
# prefill chunk and the default token budget
CPU_BF16_LINEAR_SHAPES = [(1, 768, 2048), (16, 768, 2048), (64, 768, 2048), (512, 768, 2048)]


def cpu_bf16_linear_cases(shapes: list[tuple[int, int, int]]) -> list[Case]:
    """The native linear of float32 rows and a bf16 weight (AVX-512 BF16 dot products, AMX
    tiles from 16 rows where the CPU has them) against oneDNN's bf16 GEMM on the same rows
    (rounded to bf16 and the output widened back: the casts are timed with it) and float32
    BLAS on the weight widened once: GFLOP/s."""
    result = []
    for rows, in_features, out_features in shapes:
        x = torch.randn(rows, in_features)
        weight = torch.randn(out_features, in_features).bfloat16()
        widened = weight.float()
        result.append(Case(
            f"decode_linear bf16, {rows} × {in_features} → {out_features}", "GFLOP/s",
            2 * rows * in_features * out_features, {
                "native C++": lambda x=x, w=weight: decode_linear_cpu(x, [w])[0],
                "torch (oneDNN bf16 GEMM)": lambda x=x, w=weight: F.linear(x.bfloat16(),
                                                                         w).float(),
                "torch (float32 BLAS)": lambda x=x, w=widened: F.linear(x, w)},
            backward=False))
    return result


# (rows, vocab): greedy picks of the README model's decode buckets, and Llama 3's vocabulary
CPU_ARGMAX_SHAPES = [(1, 4096), (16, 4096), (64, 4096), (16, 128256)]


def cpu_argmax_cases(shapes: list[tuple[int, int]]) -> list[Case]:
    """The native greedy pick against `torch.argmax`, fp32: GB/s of logits read."""
    result = []
    for rows, vocab in shapes:
        logits = torch.randn(rows, vocab)
        result.append(Case(f"argmax, {rows} × {vocab}", "GB/s",
                           logits.numel() * logits.element_size(), {
                               "native C++": lambda x=logits: argmax_cpu(x),
                               "torch.argmax": lambda x=logits: x.argmax(dim=-1)},
                           backward=False))
    return result


# (rows, slots, in, out): rank-16 adapters in 16 slots on the 88M model's projections at a
# decode step's rows, within the slots (each row's own A and B) and past them
CPU_LORA_SHAPES = [(1, 16, 768, 768), (16, 16, 768, 2048), (64, 16, 768, 2048)]


def cpu_lora_cases(shapes: list[tuple[int, int, int, int]], compile: bool = True) -> list[Case]:
    """Each row's own adapter (`lora_bgmv`): the native op against its reference, eager and
    compiled, fp32: GB/s of the A and B of the slots the rows name."""
    result = []
    for rows, slots, in_features, out_features in shapes:
        args, work = _lora_inputs(rows, slots, in_features, out_features, "cpu", torch.float32)
        impls = {"native C++": lambda a=args: lora_bgmv_cpu(*a),
                 "torch (eager)": lambda a=args: lora_bgmv_reference(*a)}
        if compile:
            compiled = torch.compile(lora_bgmv_reference, dynamic=False)
            impls["torch.compile"] = lambda a=args, f=compiled: f(*a)
        result.append(Case(f"lora_bgmv, {rows} rows × {slots} slots, {in_features} → "
                           f"{out_features}", "GB/s", work, impls, backward=False))
    return result


@dataclass(frozen=True)
class PrefillShape:
    """The element-wise layers of one prefill chunk: `tokens` rows of a model's widths."""

    tokens: int
    dim: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    def __str__(self) -> str:
        return f"{self.tokens} tokens of {self.dim}"


# the README bench's offline prefill (16 prompts in one step) and a Llama-3-1B chunk
CPU_PREFILL_SHAPES = [PrefillShape(1440, 128, 352, 4, 2, 32),
                      PrefillShape(512, 2048, 8192, 32, 8, 64)]


def _elementwise_cases(s: PrefillShape) -> list[Case]:
    x, residual, weight = (torch.randn(s.tokens, s.dim), torch.randn(s.tokens, s.dim),
                           torch.randn(s.dim))
    gate, up = torch.randn(s.tokens, s.hidden), torch.randn(s.tokens, s.hidden)
    q = torch.randn(1, s.tokens, s.heads, s.head_dim).transpose(1, 2)
    k = torch.randn(1, s.tokens, s.kv_heads, s.head_dim).transpose(1, 2)
    angles = torch.arange(s.tokens, dtype=torch.float32)[None, :, None] * torch.rand(s.head_dim)
    cos, sin = angles.cos(), angles.sin()
    feature = 4 * s.tokens  # bytes of one float32 feature over every token
    return [
        Case(f"rms_norm, {s}", "GB/s", 2 * feature * s.dim, {
            "native C++": lambda: rms_norm_cpu(x, weight, 1e-5),
            "torch (eager)": lambda: rms_norm_reference(x, weight, 1e-5)}, backward=False),
        Case(f"add_rms_norm, {s}", "GB/s", 4 * feature * s.dim, {
            "native C++": lambda: add_rms_norm_cpu(x, residual, weight, 1e-5),
            "torch (eager)": lambda: add_rms_norm_reference(x, residual, weight, 1e-5)},
            backward=False),
        Case(f"swiglu, {s.tokens} × {s.hidden}", "GB/s", 3 * feature * s.hidden, {
            "native C++": lambda: swiglu_cpu(gate, up),
            "torch (eager)": lambda: swiglu_reference(gate, up)}, backward=False),
        Case(f"rope, {s}, {s.heads} / {s.kv_heads} heads of {s.head_dim}", "GB/s",
             2 * feature * ((s.heads + s.kv_heads) * s.head_dim + s.head_dim), {
                 "native C++": lambda: (rope_cpu(q, cos, sin), rope_cpu(k, cos, sin)),
                 "torch (eager)": lambda: rope_reference(q, k, cos, sin)}, backward=False),
    ]


def cpu_elementwise_cases(shapes: list[PrefillShape], compile: bool = True) -> list[Case]:
    """The native RMSNorm, add+RMSNorm, SwiGLU and RoPE against their eager references and
    inductor's fusion of them (`torch.compile`), fp32: GB/s of activations read and
    written."""
    result = [case for shape in shapes for case in _elementwise_cases(shape)]
    if compile:
        for case in result:
            case.impls["torch.compile"] = torch.compile(case.impls["torch (eager)"],
                                                        dynamic=False)
    return result


def run_cpu(cases: list[Case], out: Path | None) -> str:
    """Median µs of each implementation (`torch.utils.benchmark`, which warms up and
    repeats), at this process's thread count."""
    from torch.utils import benchmark

    lines = []
    for case in cases:
        for impl, fn in case.impls.items():
            fn()  # a compiled implementation compiles here, outside the timing
            timer = benchmark.Timer("fn()", globals={"fn": fn},
                                    num_threads=torch.get_num_threads())
            seconds = timer.blocked_autorange(min_run_time=0.2).median
            lines.append(f"| {case.name} | {impl} | {seconds * 1e6:,.1f} | "
                         f"{case.work / seconds / 1e9:,.1f} {case.unit} |")
            print(lines[-1], flush=True)
    table = "\n".join([
        f"## Kernels on CPU — {datetime.date.today()} — {platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}", "",
        "Command: `python -m lathe.kernels.bench` without a GPU — fp32; paged decode over "
        "16-token blocks scattered over the pool; rate: the K/V (paged decode), weight "
        "(linear; int8 bytes for int8 weights), logit (argmax) or adapter (lora_bgmv) bytes a "
        "call must read, or "
        "the activations an element-wise layer must read and write, per second; for the bf16 "
        "linear, its multiply-adds × 2 per second.", "",
        "| case | implementation | µs | rate |", "|---|---|---:|---:|", *lines, ""])
    record(table, out)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lathe.kernels.bench")
    defaults = Sizes()
    for name, value in vars(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    add_history_arguments(parser)
    parser.add_argument("--only", type=lambda text: text.split(","), default=None,
                        help="only the kernels whose name contains one of these "
                             "comma-separated words, e.g. 'attention,paged'")
    args = vars(parser.parse_args(argv))
    out = history_folder(argparse.Namespace(**args))
    only = args.pop("only")
    args.pop("out"), args.pop("no_write")
    if not torch.cuda.is_available():
        if not load_cpu_kernels():
            print("lathe.kernels.bench measures Triton kernels on a CUDA GPU, none is "
                  "visible here, and the native CPU kernels did not build: nothing to time.")
            return 0
        print("No CUDA GPU here: timing the native CPU kernels instead of Triton's.")
        int8_shapes = [shape for shape in CPU_LINEAR_SHAPES if shape[0] <= MAX_ROWS]
        print(run_cpu(picked(cpu_paged_cases(CPU_PAGED_SHAPES)
                             + cpu_linear_cases(CPU_LINEAR_SHAPES)
                             + cpu_int8_linear_cases(int8_shapes)
                             + cpu_bf16_linear_cases(CPU_BF16_LINEAR_SHAPES)
                             + cpu_argmax_cases(CPU_ARGMAX_SHAPES)
                             + cpu_lora_cases(CPU_LORA_SHAPES)
                             + cpu_elementwise_cases(CPU_PREFILL_SHAPES), only), out))
        return 0
    print(run(Sizes(**args), out, only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
