"""int8 / int4 dequantize-matmul kernels (interpreter) against the dequantize-then-linear
references, in the serve engine's packed format. Tolerance: fp32 1e-4 relative to the
output scale (different summation order over K); fp16 and bf16 inputs 1e-2 and 2e-2."""

from __future__ import annotations

import pytest
import torch

from lathe.kernels.dispatch import kernels_off
from lathe.kernels.quant_matmul import (
    int4_matmul_reference,
    int4_matmul_triton,
    int8_matmul_reference,
    int8_matmul_triton,
)
from lathe.serve.quant import quantize_int4, quantize_int8
from tests.kernels.target import DEVICE, DTYPES, enable_kernels

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    scale = b.float().abs().max()
    assert ((a.float() - b.float()).abs().max() / scale).item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 96, 128), (5, 130, 64), (33, 64, 256)])
def test_int8_matmul_matches_reference(m, n, k, dtype):
    g = torch.Generator().manual_seed(0)
    q, scale = (t.to(DEVICE) for t in quantize_int8(torch.randn(n, k, generator=g)))
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    close(int8_matmul_triton(x, q, scale), int8_matmul_reference(x, q, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k, group", [(1, 64, 128, 128), (7, 100, 256, 32),
                                            (20, 64, 192, 64)])
def test_int4_matmul_matches_reference(m, n, k, group, dtype):
    g = torch.Generator().manual_seed(0)
    packed, scale, minimum = (t.to(DEVICE) for t in quantize_int4(
        torch.randn(n, k, generator=g), group))
    x = torch.randn(2, m, k, generator=g).to(DEVICE, dtype)
    close(int4_matmul_triton(x, packed, scale, minimum),
          int4_matmul_reference(x, packed, scale, minimum), dtype)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_matches_with_kernels_on(mode, monkeypatch):
    from lathe.serve.quant import quantize_linears
    from tests.builders import tiny_model
    model = tiny_model(n_layers=1)
    quantize_linears(model, mode, group_size=32)
    model.to(DEVICE)
    ids = torch.randint(0, 256, (2, 9), device=DEVICE)
    with torch.no_grad():
        with kernels_off():
            off = model(ids).logits
        enable_kernels(monkeypatch)
        on = model(ids).logits
    close(on, off, torch.float32)
