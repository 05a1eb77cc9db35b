"""The Triton int8 and int4 weight-only GEMMs, autotuned per row bucket
(`lathe.kernels.quant_matmul` holds the references, the CPU paths and the dispatch, and
imports this module only on the Triton path). A compiled graph calls each GEMM whole, as the
op `lathe::int8_matmul_triton` / `lathe::int4_matmul_triton`, instead of tracing the
autotuned launch: dynamo (torch 2.11) fails on the second launch of one autotuned kernel in a
graph ("ListVariable ... is already tracked for mutation", the autotuner's configs), and a
decode step launches it once per projection.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from lathe.kernels.dispatch import (
    dot_precision,
    opaque_op,
    tuning_configs,
)

# a decode step's rows, at most this many, tune apart from prefill's
FEW_ROWS = 32
# (BN, BK, warps, stages) for few rows, each at BM 16 and 32; (BM, BN, BK, warps, stages)
# for many. `all_configs` puts a small tile first, the only one the interpreter runs
# (`tuning_configs`): it serves every shape and every int4 group that is a multiple of 32.
_FEW_ROW_TILES = ((32, 128, 4, 4), (64, 128, 4, 4), (16, 256, 4, 4), (32, 256, 4, 3),
                  (64, 256, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4))
_MANY_ROW_TILES = ((64, 64, 32, 4, 3), (64, 128, 64, 4, 3), (128, 128, 32, 8, 3),
                   (128, 64, 64, 4, 4))


def all_configs() -> list[triton.Config]:
    """Every tile the autotuner may pick, the interpreter's first."""
    tiles = [(16, 32, 32, 4, 2)]
    tiles += [(bm, *tile) for bm in (16, FEW_ROWS) for tile in _FEW_ROW_TILES]
    tiles += list(_MANY_ROW_TILES)
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=stages)
            for bm, bn, bk, w, stages in tiles]


def row_bucket(m: int) -> int:
    """The tuning key's rows: 16, 32, or 64 for anything larger."""
    return 16 if m <= 16 else FEW_ROWS if m <= FEW_ROWS else 64


def prune_configs(configs: list[triton.Config], named_args: dict,
                  **_: object) -> list[triton.Config]:
    """The tiles a call's rows fit (BM of the row bucket, 64+ for many rows) whose K tile
    stays inside an int4 group; when none does (an int4 group of 32 at 17–32 rows), the
    first tile, which fits every call."""
    bucket, group = named_args["ROWS"], named_args.get("GROUP")
    fits = [c for c in configs
            if (c.kwargs["BM"] == bucket if bucket <= FEW_ROWS else c.kwargs["BM"] >= 64)
            and (group is None or group % c.kwargs["BK"] == 0)]
    return fits or configs[:1]


def _grid(m: int, n: int) -> Callable[[dict], tuple[int, int]]:
    return lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]))


@triton.autotune(configs=tuning_configs(all_configs()), key=["ROWS", "N", "K"],
                 prune_configs_by={"early_config_prune": prune_configs})
@triton.jit
def _int8_matmul(X, Q, S, Y, M, N, K, ROWS, PRECISION: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * K + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(Q + rn[:, None] * K + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0)
        # in the activation dtype
        acc += tl.dot(x, tl.trans(w).to(x.dtype), input_precision=PRECISION)
    scale = tl.load(S + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(Y + rm[:, None] * N + rn[None, :], (acc * scale[None, :]).to(Y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.autotune(configs=tuning_configs(all_configs()), key=["ROWS", "N", "K", "GROUP"],
                 prune_configs_by={"early_config_prune": prune_configs})
@triton.jit
def _int4_matmul(X, P, S, MIN, Y, M, N, K, GROUP, ROWS, PRECISION: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    half = tl.arange(0, BK // 2)
    groups = K // GROUP
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        byte = k0 // 2 + half
        packed = tl.load(P + rn[:, None] * (K // 2) + byte[None, :], mask=rn[:, None] < N,
                         other=0)
        q = tl.join(packed & 0xF, packed >> 4).reshape(BN, BK).to(tl.float32)
        g = k0 // GROUP
        scale = tl.load(S + rn * groups + g, mask=rn < N, other=0.0).to(tl.float32)
        low = tl.load(MIN + rn * groups + g, mask=rn < N, other=0.0).to(tl.float32)
        w = q * scale[:, None] + low[:, None]
        kk = k0 + tl.arange(0, BK)
        x = tl.load(X + rm[:, None] * K + kk[None, :], mask=rm[:, None] < M, other=0.0)
        acc += tl.dot(x, tl.trans(w).to(x.dtype), input_precision=PRECISION)
    tl.store(Y + rm[:, None] * N + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _int8_launch(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    (m, k), n = x2.shape, q.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _int8_matmul[_grid(m, n)](x2, q.contiguous(), scale, y, m, n, k, row_bucket(m),
                              PRECISION=dot_precision(x.dtype))
    return y.view(*x.shape[:-1], n)


def _int4_launch(x: Tensor, packed: Tensor, scale: Tensor, minimum: Tensor) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    (m, k), n = x2.shape, packed.shape[0]
    group = k // scale.shape[1]
    if group % 32:
        raise ValueError(f"int4 matmul needs groups that are multiples of 32, got {group}")
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _int4_matmul[_grid(m, n)](x2, packed.contiguous(), scale.contiguous(),
                              minimum.contiguous(), y, m, n, k, group, row_bucket(m),
                              PRECISION=dot_precision(x.dtype))
    return y.view(*x.shape[:-1], n)


_int8_op = opaque_op("int8_matmul_triton", "(Tensor x, Tensor q, Tensor scale) -> Tensor",
                     _int8_launch,
                     lambda x, q, scale: x.new_empty(*x.shape[:-1], q.shape[0]))
_int4_op = opaque_op(
    "int4_matmul_triton", "(Tensor x, Tensor packed, Tensor scale, Tensor minimum) -> Tensor",
    _int4_launch,
    lambda x, packed, scale, minimum: x.new_empty(*x.shape[:-1], packed.shape[0]))


def int8_matmul_triton(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """x @ dequantize(q, scale).T; inside a compiled graph, one opaque op."""
    launch = _int8_op if torch.compiler.is_compiling() else _int8_launch
    return launch(x, q, scale)


def int4_matmul_triton(x: Tensor, packed: Tensor, scale: Tensor, minimum: Tensor) -> Tensor:
    """x @ dequantize(packed, scale, minimum).T; inside a compiled graph, one opaque op."""
    launch = _int4_op if torch.compiler.is_compiling() else _int4_launch
    return launch(x, packed, scale, minimum)
