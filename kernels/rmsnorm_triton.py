"""The Triton forward and backward of RMSNorm and of residual-add fused with RMSNorm
(`lathe.kernels.rmsnorm` holds the reference and the dispatch, and imports this module
only on the Triton path, so lathe runs where Triton is not installed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_forward(X, R, S, W, Y, RSTD, n_rows, n_cols, eps, HAS_RESIDUAL: tl.constexpr,
                      BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Y = rms_norm(X [+ R]) row by row; with a residual R the sum is also stored in S."""
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < n_rows:
            x = tl.load(X + row * n_cols + cols, mask=col_ok, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(R + row * n_cols + cols, mask=col_ok, other=0.0).to(tl.float32)
                total = (x + r).to(X.dtype.element_ty)
                tl.store(S + row * n_cols + cols, total, mask=col_ok)
                x = total.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
            tl.store(RSTD + row, rstd)
            normed = (x * rstd).to(X.dtype.element_ty)
            tl.store(Y + row * n_cols + cols, (normed * w).to(Y.dtype.element_ty), mask=col_ok)


@triton.jit
def _rms_norm_backward(X, W, DY, RSTD, DX, DW_PARTIAL, n_rows, n_cols,
                       BLOCK: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < n_rows:
            x = tl.load(X + row * n_cols + cols, mask=col_ok, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * n_cols + cols, mask=col_ok, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            normed = x * rstd
            dw += dy * normed.to(X.dtype.element_ty).to(tl.float32)
            g = dy * w  # gradient at the normalized value
            dx = rstd * (g - normed * tl.sum(g * normed, axis=0) / n_cols)
            tl.store(DX + row * n_cols + cols, dx.to(DX.dtype.element_ty), mask=col_ok)
    tl.store(DW_PARTIAL + tl.program_id(0) * n_cols + cols, dw, mask=col_ok)


def _launch_shape(n_rows: int, n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    rows = 16 if n_rows >= 16 * 64 else 4  # a few rows per program: fewer launches
    return block, rows


def _forward(x: Tensor, residual: Tensor | None, weight: Tensor,
             eps: float) -> tuple[Tensor, Tensor, Tensor]:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    n_rows, n_cols = x2.shape
    r2 = residual.reshape(-1, n_cols).contiguous() if residual is not None else x2
    total = torch.empty_like(x2) if residual is not None else x2
    y = torch.empty_like(x2, dtype=torch.promote_types(x2.dtype, weight.dtype))
    rstd = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    block, rows = _launch_shape(n_rows, n_cols)
    _rms_norm_forward[(triton.cdiv(n_rows, rows),)](
        x2, r2, total, weight, y, rstd, n_rows, n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, ROWS=rows)
    return y, total, rstd


def _backward(total: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    n_rows, n_cols = total.shape
    block, rows = _launch_shape(n_rows, n_cols)
    programs = triton.cdiv(n_rows, rows)
    dx = torch.empty_like(total)
    partial = torch.empty(programs, n_cols, device=total.device, dtype=torch.float32)
    _rms_norm_backward[(programs,)](total, weight, dy.reshape(-1, n_cols).contiguous(), rstd,
                                    dx, partial, n_rows, n_cols, BLOCK=block, ROWS=rows)
    return dx, partial.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, total, rstd = _forward(x, None, weight, eps)
        ctx.save_for_backward(total, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, None]:
        dx, dw = _backward(*ctx.saved_tensors, dy)
        return dx.view(dy.shape), dw, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor, weight: Tensor,
                eps: float) -> tuple[Tensor, Tensor]:
        y, total, rstd = _forward(x, residual, weight, eps)
        ctx.save_for_backward(total, weight, rstd)
        return y.view(x.shape), total.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor, dtotal: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        dx, dw = _backward(*ctx.saved_tensors, dy)
        d = dx.view(dy.shape) + dtotal  # the sum feeds both the norm and the residual stream
        return d, d, dw, None


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _RMSNorm.apply(x, weight, eps)


def add_rms_norm_triton(x: Tensor, residual: Tensor, weight: Tensor,
                        eps: float) -> tuple[Tensor, Tensor]:
    return _AddRMSNorm.apply(x, residual, weight, eps)
