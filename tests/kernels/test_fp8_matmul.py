"""The W8A8 FP8 matmul against compressed-tensors' own fake quantization (the computation
transformers runs for an FP8_DYNAMIC checkpoint): its per-token rounding of the inputs, its
per-channel rounding of the weights, and the product through each path lathe takes."""

from __future__ import annotations

import pytest
import torch

from lathe.kernels.fp8_matmul import (
    FP8,
    fp8_matmul,
    fp8_matmul_reference,
    fp8_scales,
    quantize_fp8_rows,
    to_fp8,
    uses_tensor_cores,
)

compressed_tensors = pytest.importorskip("compressed_tensors")


def library_args(strategy: str):
    from compressed_tensors.quantization import QuantizationArgs
    return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy,
                            dynamic=strategy == "token")


def hostile_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """Gaussian rows with a zero row, a row of one sign, an outlier and a subnormal-sized row."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    x[1] = 0
    x[2] = x[2].abs()
    x[3, 5] = 3e4
    x[4] *= 1e-6
    return x


def test_weights_round_as_compressed_tensors_rounds_fp8_dynamic():
    """Per-channel scales and float8 values equal the library's `calculate_qparams` +
    `quantize` over the same rows, hostile rows included."""
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    w = hostile_rows(16, 64, seed=0)
    args = library_args("channel")
    scale, zero_point = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True),
                                          args)
    expected = quantize(w, scale, zero_point, args, dtype=FP8)
    q, ours = quantize_fp8_rows(w)
    nonzero = w.abs().amax(-1) > 0  # the zero row's scale differs, its values are zeros
    assert torch.equal(ours[nonzero], scale.reshape(-1)[nonzero]) and not nonzero.all()
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


def test_inputs_round_per_token_as_the_library_rounds_them():
    """Each token's row of a (batch, tokens, width) input is fake-quantized as the library's
    dynamic per-token scheme does it in transformers' forward: the same scales (but for
    the zero row's, which rounds to zeros either way) and the same values."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    x = hostile_rows(12, 64, seed=1).reshape(2, 6, 64)
    args = library_args("token")
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, torch.nn.Module())
    expected = fake_quantize(x, scale, zero_point, args)
    ours = fp8_scales(x)
    nonzero = x.abs().amax(-1, keepdim=True) > 0
    assert torch.equal(ours[nonzero], scale[nonzero]) and not nonzero.all()
    assert torch.equal(to_fp8(x, ours).float() * ours, expected)


@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (2, 5, 64)])
def test_every_path_computes_the_references_product(shape):
    """Through the weight widened to bf16 (the CPU's native half-weight op, scales after the
    sum) the product is the reference's to float32 rounding; bf16 x too, to bf16's."""
    torch.manual_seed(0)
    x = torch.randn(*shape) * 3
    q, scale = quantize_fp8_rows(torch.randn(48, 64))
    expected = fp8_matmul_reference(x, q, scale)
    torch.testing.assert_close(fp8_matmul(x, q, scale, q.to(torch.bfloat16)), expected,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp8_matmul(x, q, scale), expected)
    half = x.to(torch.bfloat16)
    torch.testing.assert_close(fp8_matmul(half, q, scale, q.to(torch.bfloat16)).float(),
                               fp8_matmul_reference(half, q, scale).float(), rtol=2e-2,
                               atol=2e-2)


def test_the_cpu_never_takes_the_tensor_core_gemm():
    """cuBLASLt's FP8 GEMM is for CUDA bf16 operands 16-aligned; the CPU (where torch's FP8
    GEMM is 30-50× slower than float32's) always widens."""
    q, _ = quantize_fp8_rows(torch.randn(32, 64))
    assert not uses_tensor_cores(torch.randn(4, 64, dtype=torch.bfloat16), q)


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)")
def test_the_tensor_core_gemm_computes_the_references_product():
    torch.manual_seed(0)
    x = (torch.randn(3, 7, 256) * 3).cuda().to(torch.bfloat16)
    q, scale = quantize_fp8_rows(torch.randn(512, 256).cuda())
    assert uses_tensor_cores(x, q)
    torch.testing.assert_close(fp8_matmul(x, q, scale).float(),
                               fp8_matmul_reference(x, q, scale).float(), rtol=2e-2, atol=2e-2)
