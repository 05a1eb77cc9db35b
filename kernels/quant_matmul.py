"""Weight-only quantized matmuls in the serve engine's packed formats, dequantizing tiles
on the fly inside a Triton matmul (the weight never exists in full precision), beside the
PyTorch references that dequantize first. On CPU they run torch's own int8/int4 GEMMs
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`, gpt-fast's CPU path), which read
the packed weight directly and are vectorized for bf16 activations: inputs are rounded to
bf16 on the way in (~0.5% of the output scale, the size of the int8 weight error itself).
Float32 rows take lathe's native int8 op instead (`lathe.kernels.decode_linear`), which
reads them unrounded, costs less per call and per row, and joins the linears that read the
same x in a compiled graph.

int8: w[n, k] = q[n, k] · scale[n]; the scale is applied once per output column after
the K loop. int4: two values per byte (low nibble = even column), w[n, k] = q · scale +
minimum per (n, k // group); a K tile never crosses a group.

The Triton tiles are autotuned per (row bucket, N, K). A decode step's few rows (≤ 32)
make the GEMM a stream over the weight, which beats dense only at memory bandwidth: that
takes enough programs to fill the GPU (narrow N tiles on a ~1B model's 2,048-wide layers),
wide K slices (128–256 bytes of a weight row a load; the fixed 32-byte slices read one
sector each) and deep pipelines; which of them wins depends on the GPU and the shape, so
it is measured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lathe.kernels.cpu_native import cpu_kernels_loaded, native_kernel
from lathe.kernels.decode_linear import decode_linear_int8_cpu
from lathe.kernels.dispatch import (
    opaque_op,
    use_cpu_kernel,
    use_triton,
)


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def dequantize_int4(packed: Tensor, scale: Tensor, minimum: Tensor,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    out_features = packed.shape[0]
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(out_features, -1).float()
    group = q.shape[1] // scale.shape[1]
    w = q.reshape(out_features, -1, group) * scale.float()[..., None] + minimum.float()[..., None]
    return w.reshape(out_features, -1).to(dtype)


def int8_matmul_reference(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    return F.linear(x, dequantize_int8(q, scale, x.dtype))


def int4_matmul_reference(x: Tensor, packed: Tensor, scale: Tensor, minimum: Tensor) -> Tensor:
    return F.linear(x, dequantize_int4(packed, scale, minimum, x.dtype))


def _aligned(t: Tensor) -> Tensor:
    """`t` in memory torch's CPU GEMMs can read: they crash (SIGSEGV) on a tensor whose data
    is not 64-byte aligned, e.g. one viewed straight out of a safetensors file."""
    t = t.contiguous()
    return t if t.data_ptr() % 64 == 0 else t.clone()


def int4_pack_for_cpu(packed: Tensor, scale: Tensor, minimum: Tensor) -> tuple[Tensor, Tensor]:
    """Our int4 layout as torch's CPU int4 GEMM takes it: its packed weight, and per group
    (scale, zero) with w = (q − 8) · scale + zero, i.e. zero = minimum + 8 · scale."""
    out_features = packed.shape[0]
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(out_features, -1)
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    zeros = minimum.float() + 8 * scale.float()
    scales_zeros = torch.stack([scale.float(), zeros], dim=-1).transpose(0, 1).contiguous()
    return weight, scales_zeros.to(torch.bfloat16)


def _int8_gemm_bf16(x2: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    return torch.ops.aten._weight_int8pack_mm(_aligned(x2), _aligned(q), scale)


def _int4_gemm_bf16(x2: Tensor, weight: Tensor, scales_zeros: Tensor) -> Tensor:
    group = x2.shape[-1] // scales_zeros.shape[0]
    return torch.ops.aten._weight_int4pack_mm_for_cpu(_aligned(x2), weight, group, scales_zeros)


# The same GEMMs as ops on bf16 rows, which a compiled graph (`lathe.serve.decode_graph`)
# calls whole: inside, the tensors are real, so `_aligned` can test their addresses, and
# inductor's own lowering of `_weight_int8pack_mm` fails on a fused dtype cast as input.
# The casts stay outside, where inductor fuses them into the ops around the GEMM. Eager
# code calls the plain functions: even a cheap op's dispatch is paid 29 times a step.
_int8_gemm_op = opaque_op("int8_matmul_cpu", "(Tensor x2, Tensor q, Tensor scale) -> Tensor",
                          _int8_gemm_bf16,
                          lambda x2, q, scale: x2.new_empty(x2.shape[0], q.shape[0]))
_int4_gemm_op = opaque_op(
    "int4_matmul_cpu", "(Tensor x2, Tensor weight, Tensor scales_zeros) -> Tensor",
    _int4_gemm_bf16,
    lambda x2, weight, scales_zeros: x2.new_empty(x2.shape[0], scales_zeros.shape[1]))


# The same two ops in C++ (csrc/quant_matmul_cpu.cpp), which a compiled graph calls for
# ~1 µs of dispatch against ~4 µs for the Python ones above, when the native CPU kernels
# are loaded (`lathe.kernels.cpu_native`)
_int8_gemm_native = opaque_op(
    "int8_matmul_cpu_native", "(Tensor x2, Tensor q, Tensor scale) -> Tensor", None,
    lambda x2, q, scale: x2.new_empty(x2.shape[0], q.shape[0]))
_int4_gemm_native = opaque_op(
    "int4_matmul_cpu_native", "(Tensor x2, Tensor weight, Tensor scales_zeros) -> Tensor", None,
    lambda x2, weight, scales_zeros: x2.new_empty(x2.shape[0], scales_zeros.shape[1]))


def _graph_gemm(python_op: Callable, native_op: Callable) -> Callable:
    """The op a compiled graph calls: the native one when the library is loaded."""
    return native_op if cpu_kernels_loaded() else python_op


def _on_bf16_rows(gemm: Callable[[Tensor, Tensor, Tensor], Tensor], x: Tensor, weight: Tensor,
                  scale: Tensor, out_features: int) -> Tensor:
    """`gemm` (a torch CPU weight-only GEMM, which takes bf16 activations) on `x` of any
    leading shape and dtype."""
    y = gemm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), weight, scale.to(torch.bfloat16))
    return y.to(x.dtype).view(*x.shape[:-1], out_features)


# torch's CPU int8 GEMM reads K in steps of 16: any other width computes wrong values (at 24
# or 40 columns) or crashes (measured on torch 2.13)
INT8_GEMM_K_STEP = 16


def int8_matmul_cpu(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x @ dequantize(q, scale).T: float32 rows through lathe's native int8 op (a prefill's
    too: 1.3-1.5× torch's int8 GEMM on bf16 rows at 33-512 rows of the 88M model's layers,
    and x unrounded), anything else through torch's CPU int8 GEMM (the reference for a width
    it cannot take)."""
    x2 = x.reshape(-1, x.shape[-1])
    if (x.dtype == torch.float32 and scale.dtype == torch.float32 and x2.shape[0] >= 1
            and native_kernel("decode_linear", x)):
        return decode_linear_int8_cpu(x2, [(q, scale)])[0].view(*x.shape[:-1], q.shape[0])
    if x.shape[-1] % INT8_GEMM_K_STEP:
        return int8_matmul_reference(x, q, scale)
    gemm = _graph_gemm(_int8_gemm_op, _int8_gemm_native) if torch.compiler.is_compiling() \
        else _int8_gemm_bf16
    return _on_bf16_rows(gemm, x, q, scale, q.shape[0])


def int4_matmul_cpu(x: Tensor, weight: Tensor, scales_zeros: Tensor) -> Tensor:
    """x @ w.T from `int4_pack_for_cpu`'s (weight, scales_zeros), through torch's CPU int4
    GEMM."""
    gemm = _graph_gemm(_int4_gemm_op, _int4_gemm_native) if torch.compiler.is_compiling() \
        else _int4_gemm_bf16
    return _on_bf16_rows(gemm, x, weight, scales_zeros, scales_zeros.shape[1])


def int8_matmul(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x @ dequantize(q, scale).T (Triton on CUDA, torch's int8 GEMM on CPU)."""
    if use_triton("int8_matmul", x):
        from lathe.kernels.quant_matmul_triton import int8_matmul_triton
        return int8_matmul_triton(x, q, scale)
    if use_cpu_kernel("int8_matmul", x):
        return int8_matmul_cpu(x, q, scale)
    return int8_matmul_reference(x, q, scale)


def int4_matmul(x: Tensor, packed: Tensor, scale: Tensor, minimum: Tensor) -> Tensor:
    """x @ dequantize(packed, scale, minimum).T (Triton on CUDA, the reference elsewhere)."""
    if use_triton("int4_matmul", x):
        from lathe.kernels.quant_matmul_triton import int4_matmul_triton
        return int4_matmul_triton(x, packed, scale, minimum)
    return int4_matmul_reference(x, packed, scale, minimum)
