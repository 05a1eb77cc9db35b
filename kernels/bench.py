"""`python -m lathe.kernels.bench`: each Triton kernel against its PyTorch reference and
`torch.compile` of the reference (and Liger's, when `liger-kernel` is installed), forward
and forward+backward, as time and achieved GB/s. Needs a CUDA GPU: without one it says so
and exits cleanly. The table is printed and appended to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable
from pathlib import Path

import torch

from lathe.kernels.rmsnorm import add_rms_norm_triton, rms_norm_reference, rms_norm_triton
from lathe.kernels.swiglu import swiglu_reference, swiglu_triton

ROOT = Path(__file__).resolve().parents[1]


def bench(fn: Callable[[], object], backward: bool) -> float:
    """Median milliseconds of `fn` (and its backward) by triton's do_bench."""
    from triton.testing import do_bench

    def step() -> None:
        out = fn()
        if backward:
            out = out[0] if isinstance(out, tuple) else out
            out.backward(torch.ones_like(out))
    return do_bench(step)


def cases(rows: int, dim: int, hidden: int, dtype: torch.dtype) -> list[tuple]:
    device = "cuda"
    x = torch.randn(rows, dim, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.ones(dim, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
    u = torch.randn_like(g, requires_grad=True)
    size = x.element_size()
    compiled_norm = torch.compile(rms_norm_reference)
    compiled_swiglu = torch.compile(swiglu_reference)
    out = [
        ("rms_norm", 2 * x.numel() * size, {
            "triton": lambda: rms_norm_triton(x, w, 1e-5),
            "torch": lambda: rms_norm_reference(x, w, 1e-5),
            "torch.compile": lambda: compiled_norm(x, w, 1e-5)}),
        ("add_rms_norm", 4 * x.numel() * size, {
            "triton": lambda: add_rms_norm_triton(x, r, w, 1e-5),
            "torch": lambda: rms_norm_reference(x + r, w, 1e-5),
            "torch.compile": lambda: compiled_norm(x + r, w, 1e-5)}),
        ("swiglu", 3 * g.numel() * size, {
            "triton": lambda: swiglu_triton(g, u),
            "torch": lambda: swiglu_reference(g, u),
            "torch.compile": lambda: compiled_swiglu(g, u)}),
    ]
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        out[0][2]["liger"] = lambda: LigerRMSNormFunction.apply(x, w, 1e-5)
        out[2][2]["liger"] = lambda: LigerSiLUMulFunction.apply(g, u)
    except ImportError:
        pass
    return out


def run(rows: int, dim: int, hidden: int, write: bool) -> str:
    dtype = torch.bfloat16
    lines = []
    for name, forward_bytes, impls in cases(rows, dim, hidden, dtype):
        for impl, fn in impls.items():
            fwd, both = bench(fn, False), bench(fn, True)
            lines.append(f"| {name} | {impl} | {fwd * 1e3:,.1f} | "
                         f"{forward_bytes / fwd / 1e6:,.0f} | {both * 1e3:,.1f} |")
            print(lines[-1], flush=True)
    table = "\n".join([
        f"## Kernels — {datetime.date.today()} — {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}", "",
        f"Command: `python -m lathe.kernels.bench` — {rows} rows × {dim} (norms), "
        f"{rows} × {hidden} (SwiGLU), bf16", "",
        "| kernel | implementation | forward µs | forward GB/s | forward+backward µs |",
        "|---|---|---:|---:|---:|", *lines, ""])
    if write:
        with (ROOT / "docs" / "benchmarks.md").open("a") as f:
            f.write("\n" + table)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lathe.kernels.bench")
    parser.add_argument("--rows", type=int, default=8 * 2048)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--no-write", dest="write", action="store_false")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("lathe.kernels.bench measures Triton kernels on a CUDA GPU; none is visible "
              "here, so there is nothing to time (CPU runs the PyTorch references).")
        return 0
    print(run(args.rows, args.dim, args.hidden, args.write))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
