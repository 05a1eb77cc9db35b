"""The linear layers of a CPU decode step at a few rows: `lathe::decode_linear_cpu` for
float32, bfloat16 and float16 weights and `lathe::decode_linear_int8_cpu` for serving's int8
weights with a per-output scale (csrc/decode_linear_cpu.cpp), each taking one to `MAX_GROUP`
weights that read the same float32 x, beside the reference `F.linear`.

At a few rows BLAS's GEMM costs a fixed ~2 µs a call, most of a small layer's time, and
streams a large weight (the LM head) at a fraction of what two cores read; the float32 op
takes 20-85% of its time, the less the fewer the rows. torch's int8 GEMM takes bf16 rows
and costs ~4 µs a call; the int8 op takes float32 rows, widens the weights in registers,
and reads a Llama-1B projection in 70-80% of torch's time. A compiled graph reaches them
through `lathe.kernels.decode_linear_pass` (float32) and `lathe.kernels.quant_matmul`
(int8); an eager serving model through `DecodeLinear`, the `nn.Linear` its float32
projections become (`use_decode_linears`), which takes the native op for a step's few rows
at inference and `F.linear` for everything else.

Half weights serve a float32 model on the CPU (`lathe.serve.half_weights`): a decode step is
a stream over the weights, and bf16 or fp16 halves the bytes. Their float32 rows take the
native op at every row count, prefill's too: it widens the weights in registers, or on a CPU
with AVX-512 BF16 meets bf16 weights with x rounded to bf16 (32 products an instruction),
which kept pace with oneDNN's bf16 GEMM up to 128 rows on an AMD EPYC (85% of it at 512); on
a CPU with AMX (Sapphire Rapids and later) from 16 rows on it multiplies in AMX tiles
instead, as oneDNN does there (a 2048 × 768 layer at 512 rows: 3.4 ms against 16.4 with
AVX-512 BF16 and oneDNN's 2.4-3.0). Unlike oneDNN's it sums and returns float32, and every
row count makes the same products: a prefill, a chunk and a decode step differ only in the
order of their sums. torch's fp16 GEMM is 4× slower than float32's here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lathe.kernels.cpu_native import native_kernel
from lathe.kernels.dispatch import opaque_op

# Up to here the native op beats BLAS (MKL) on every layer of the README model on this
# project's 2-core AMD machine: 20-60% of MKL's time at 1-8 rows, 70% at 16 and 80-85% at
# 32 (`python -m lathe.kernels.bench`); at 64 rows they are level
MAX_ROWS = 32

HALF_DTYPES = (torch.bfloat16, torch.float16)  # weights the native op widens


def decode_linear_reference(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """(M, in) rows times each (out_i, in) weight: [(M, out_i)]."""
    return [F.linear(x, weight) for weight in weights]


def _outputs_like(x: Tensor, *weights: Tensor) -> Tensor | tuple[Tensor, ...]:
    outs = tuple(x.new_empty(x.shape[0], weight.shape[0]) for weight in weights)
    return outs[0] if len(outs) == 1 else outs


# one op per group size (inductor's C++ wrapper would call a Tensor[] argument through Python)
GROUP_OPS = [
    opaque_op("decode_linear_cpu", "(Tensor x, Tensor w0) -> Tensor", None, _outputs_like),
    opaque_op("decode_linear2_cpu", "(Tensor x, Tensor w0, Tensor w1) -> (Tensor, Tensor)",
              None, _outputs_like),
    opaque_op("decode_linear3_cpu",
              "(Tensor x, Tensor w0, Tensor w1, Tensor w2) -> (Tensor, Tensor, Tensor)", None,
              _outputs_like),
]
MAX_GROUP = len(GROUP_OPS)


def _int8_outputs_like(x: Tensor, *weights_and_scales: Tensor) -> Tensor | tuple[Tensor, ...]:
    return _outputs_like(x, *weights_and_scales[::2])


INT8_GROUP_OPS = [
    opaque_op("decode_linear_int8_cpu", "(Tensor x, Tensor q0, Tensor s0) -> Tensor", None,
              _int8_outputs_like),
    opaque_op("decode_linear_int8_2_cpu",
              "(Tensor x, Tensor q0, Tensor s0, Tensor q1, Tensor s1) -> (Tensor, Tensor)", None,
              _int8_outputs_like),
    opaque_op("decode_linear_int8_3_cpu",
              "(Tensor x, Tensor q0, Tensor s0, Tensor q1, Tensor s1, Tensor q2, Tensor s2) -> "
              "(Tensor, Tensor, Tensor)", None, _int8_outputs_like),
]


def _grouped(name: str, ops: list, x: Tensor, weights: list, operands: list[Tensor],
             ) -> list[Tensor]:
    if not 1 <= len(weights) <= MAX_GROUP:
        raise ValueError(f"{name} takes 1 to {MAX_GROUP} weights, got {len(weights)}")
    out = ops[len(weights) - 1](x, *operands)
    return [out] if len(weights) == 1 else list(out)


def decode_linear_cpu(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """The native op for 1 to MAX_GROUP weights that read the same x: [(M, out_i)]."""
    return _grouped("decode_linear_cpu", GROUP_OPS, x, weights, weights)


def decode_linear_int8_cpu(x: Tensor, weights: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """The native op for 1 to MAX_GROUP int8 weights, each with its float32 per-output
    scale, that read the same float32 x: [(M, out_i)] = x · (q_i · s_i)ᵀ."""
    return _grouped("decode_linear_int8_cpu", INT8_GROUP_OPS, x, weights,
                    [t for pair in weights for t in pair])


def _native_rows(weight: Tensor) -> int:
    """How many float32 rows the native op takes against `weight` at inference: any number
    for a half weight, up to MAX_ROWS for a float32 one (BLAS is level past it), none for a
    weight of another dtype."""
    if weight.dtype in HALF_DTYPES:
        return 1 << 62
    return MAX_ROWS if weight.dtype == torch.float32 else 0


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T (+ bias) for inference. Float32 rows on the CPU take the native op where
    autograd is off (it has no backward): for a float32 weight up to MAX_ROWS rows, outside
    a graph being compiled (whose pass groups the linears that share an input); for a half
    weight always. Everything else goes through `F.linear`, a half weight widened to x's
    dtype."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (1 <= rows <= _native_rows(weight) and x.dtype == torch.float32
            and not torch.is_grad_enabled()
            and (weight.dtype in HALF_DTYPES or not torch.compiler.is_compiling())
            and native_kernel("decode_linear", x)):
        y = decode_linear_cpu(x.reshape(rows, x.shape[-1]), [weight])[0]
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight.to(x.dtype), bias)


class DecodeLinear(nn.Linear):
    """An `nn.Linear` (the same parameters and state dict) whose calls go through `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def bound_linear(module: nn.Module) -> Callable[[Tensor], Tensor]:
    """`module`'s forward for inference, with the choice `linear` makes on every call made
    once where it can be: for a bias-free float32 or half `DecodeLinear` on the CPU whose op
    is on, a function that hands float32 rows (all of a half weight's, up to `MAX_ROWS` of a
    float32 one's) straight to the native op; else the module itself. For a hot call
    outside a compiled graph — a compiled serving step's LM head, where choosing again each
    call was ~20 µs of the README model's 230 µs step."""
    if type(module) is not DecodeLinear or module.bias is not None:
        return module
    weight, op = module.weight, GROUP_OPS[0]
    max_rows = _native_rows(weight)
    if not max_rows or not native_kernel("decode_linear", weight):
        return module

    def forward(x: Tensor) -> Tensor:
        if (x.dtype == torch.float32 and x.dim() == 2 and 1 <= x.shape[0] <= max_rows
                and not torch.is_grad_enabled()):
            return op(x, module.weight)
        return module(x)
    return forward


def use_decode_linears(model: nn.Module) -> int:
    """Make every plain `nn.Linear` of `model` a `DecodeLinear`, in place (its parameters,
    hooks and wrappers stay as they are); how many. For a model that only serves: its
    training would still be right, through `F.linear`, but gains nothing."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DecodeLinear
            count += 1
    return count
