"""The Triton causal attention, FlashAttention-2 style, forward and backward, autotuned
(`lathe.kernels.attention` holds the reference and imports this module only on the
Triton path).

Packed rows (several documents in one row, each a contiguous run) pass each query's
document start: a query sees only keys from its start on, and the loops begin at the
first tile a row's document reaches (forward, dQ) and end at the last tile that can see
a key tile (dK, dV), so the work is that of the documents, not of the whole row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lathe.kernels.attention import check_shapes
from lathe.kernels.dispatch import dot_precision, tuning_configs


def _configs() -> list[triton.Config]:
    return tuning_configs([
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in ((64, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3))
    ])


@triton.jit
def _tile(ptr, rows, n_rows, row_stride, dims, HEAD_DIM: tl.constexpr):
    mask = (rows[:, None] < n_rows) & (dims[None, :] < HEAD_DIM)
    return tl.load(ptr + rows[:, None] * row_stride + dims[None, :], mask=mask, other=0.0)


@triton.jit
def _causal(rows, cols, offset, seq_k):
    """Which (row, col) scores exist: bottom-right causal, inside the key length."""
    return (cols[None, :] <= rows[:, None] + offset) & (cols[None, :] < seq_k)


@triton.jit
def _visible(rows, cols, offset, seq_q, seq_k, starts_base, DOCUMENTS: tl.constexpr):
    """`_causal`, and with DOCUMENTS each row sees no key before its document's start."""
    visible = _causal(rows, cols, offset, seq_k)
    if DOCUMENTS:
        row_start = tl.load(starts_base + rows, mask=rows < seq_q, other=0)
        visible = visible & (cols[None, :] >= row_start[:, None])
    return visible


@triton.jit
def _first_key_tile(starts_base, start_m, BLOCK_N: tl.constexpr, DOCUMENTS: tl.constexpr):
    """Where a query tile's key loop begins: 0, or the tile of its first row's document
    start (starts never decrease along a row)."""
    if DOCUMENTS:
        return tl.load(starts_base + start_m) // BLOCK_N * BLOCK_N
    return 0


@triton.autotune(configs=_configs(), key=["LENGTH_BUCKET", "HEAD_DIM", "DOCUMENTS"])
@triton.jit
def _forward(Q, K, V, OUT, LSE, STARTS, SCALE: tl.constexpr, seq_q, seq_k, n_heads, group,
             q_batch, q_head, q_row, k_batch, k_head, k_row, v_batch, v_head, v_row,
             LENGTH_BUCKET, DOCUMENTS: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_D: tl.constexpr,
             PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    batch, head = tl.program_id(1) // n_heads, tl.program_id(1) % n_heads
    kv_head = head // group
    offset = seq_k - seq_q
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _tile(Q + batch * q_batch + head * q_head, rows, seq_q, q_row, dims, HEAD_DIM)
    k_base = K + batch * k_batch + kv_head * k_head
    v_base = V + batch * v_batch + kv_head * v_head
    running_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # SCALE is a constexpr: torch.compile hands a Python float argument to a user kernel as
    # fp64, which would turn the loop-carried running_max fp64 and fail to compile.
    qk_scale = SCALE * 1.4426950408889634  # exp2 instead of exp
    starts_base = STARTS + batch * seq_q
    end = tl.minimum(seq_k, start_m + BLOCK_M + offset)
    for start_n in range(_first_key_tile(starts_base, start_m, BLOCK_N, DOCUMENTS), end,
                         BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _tile(k_base, cols, seq_k, k_row, dims, HEAD_DIM)
        v = _tile(v_base, cols, seq_k, v_row, dims, HEAD_DIM)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = _visible(rows, cols, offset, seq_q, seq_k, starts_base, DOCUMENTS)
        scores = tl.where(visible, scores, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # a row whose document starts past this tile has seen nothing yet: exp2(-inf - 0)
        # keeps it at zero where exp2(-inf + inf) would be NaN
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        p = tl.exp2(scores - shift[:, None])
        correction = tl.exp2(running_max - shift)
        total = total * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    out = acc / total[:, None]
    row_ok = rows < seq_q
    out_rows = (tl.program_id(1) * seq_q + rows) * HEAD_DIM
    tl.store(OUT + out_rows[:, None] + dims[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & (dims[None, :] < HEAD_DIM))
    tl.store(LSE + tl.program_id(1) * seq_q + rows,
             (running_max + tl.log2(total)) / 1.4426950408889634, mask=row_ok)


@triton.autotune(configs=_configs(), key=["LENGTH_BUCKET", "HEAD_DIM", "DOCUMENTS"])
@triton.jit
def _backward_dq(Q, K, V, DO, LSE, DELTA, DQ, STARTS, SCALE: tl.constexpr, seq_q, seq_k,
                 n_heads, group,
                 k_batch, k_head, k_row, v_batch, v_head, v_row,
                 LENGTH_BUCKET, DOCUMENTS: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_D: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    batch, head = tl.program_id(1) // n_heads, tl.program_id(1) % n_heads
    kv_head = head // group
    offset = seq_k - seq_q
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    base = tl.program_id(1) * seq_q * HEAD_DIM  # Q, DO and DQ are contiguous here
    q = _tile(Q + base, rows, seq_q, HEAD_DIM, dims, HEAD_DIM)
    do = _tile(DO + base, rows, seq_q, HEAD_DIM, dims, HEAD_DIM)
    lse = tl.load(LSE + tl.program_id(1) * seq_q + rows, mask=rows < seq_q, other=0.0)
    delta = tl.load(DELTA + tl.program_id(1) * seq_q + rows, mask=rows < seq_q, other=0.0)
    k_base = K + batch * k_batch + kv_head * k_head
    v_base = V + batch * v_batch + kv_head * v_head
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    starts_base = STARTS + batch * seq_q
    end = tl.minimum(seq_k, start_m + BLOCK_M + offset)
    for start_n in range(_first_key_tile(starts_base, start_m, BLOCK_N, DOCUMENTS), end,
                         BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _tile(k_base, cols, seq_k, k_row, dims, HEAD_DIM)
        v = _tile(v_base, cols, seq_k, v_row, dims, HEAD_DIM)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SCALE
        visible = (_visible(rows, cols, offset, seq_q, seq_k, starts_base, DOCUMENTS)
                   & (rows[:, None] < seq_q))
        p = tl.where(visible, tl.exp(scores - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + base + rows[:, None] * HEAD_DIM + dims[None, :],
             (dq * SCALE).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < seq_q) & (dims[None, :] < HEAD_DIM))


@triton.autotune(configs=_configs(), key=["LENGTH_BUCKET", "HEAD_DIM", "DOCUMENTS"])
@triton.jit
def _backward_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, STARTS, ENDS, SCALE: tl.constexpr, seq_q,
                   seq_k, n_heads, n_kv_heads,
                   group, k_batch, k_head, k_row, v_batch, v_head, v_row,
                   LENGTH_BUCKET, DOCUMENTS: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_D: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    batch, kv_head = tl.program_id(1) // n_kv_heads, tl.program_id(1) % n_kv_heads
    offset = seq_k - seq_q
    cols = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k = _tile(K + batch * k_batch + kv_head * k_head, cols, seq_k, k_row, dims, HEAD_DIM)
    v = _tile(V + batch * v_batch + kv_head * v_head, cols, seq_k, v_row, dims, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M  # earliest row seeing a col
    starts_base = STARTS + batch * seq_q
    stop = seq_q
    if DOCUMENTS:  # no row past the end of the tile's last key's document sees the tile
        stop = tl.load(ENDS + batch * seq_q + tl.minimum(start_n + BLOCK_N, seq_k) - 1)
    for g in range(0, group):
        query_head = batch * n_heads + kv_head * group + g
        base = query_head * seq_q * HEAD_DIM
        for start_m in range(first, stop, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            q = _tile(Q + base, rows, seq_q, HEAD_DIM, dims, HEAD_DIM)
            do = _tile(DO + base, rows, seq_q, HEAD_DIM, dims, HEAD_DIM)
            lse = tl.load(LSE + query_head * seq_q + rows, mask=rows < seq_q, other=0.0)
            delta = tl.load(DELTA + query_head * seq_q + rows, mask=rows < seq_q, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SCALE
            visible = (_visible(rows, cols, offset, seq_q, seq_k, starts_base, DOCUMENTS)
                       & (rows[:, None] < seq_q))
            p = tl.where(visible, tl.exp(scores - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    out = (tl.program_id(1) * seq_k + cols[:, None]) * HEAD_DIM + dims[None, :]
    mask = (cols[:, None] < seq_k) & (dims[None, :] < HEAD_DIM)
    tl.store(DK + out, (dk * SCALE).to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=mask)


def _strides(t: Tensor) -> tuple[int, int, int]:
    if t.stride(-1) != 1:
        raise ValueError("attention kernels need the head dimension contiguous (stride 1)")
    return t.stride(0), t.stride(1), t.stride(2)


def _launch_args(q: Tensor, seq_k: int, documents: bool) -> dict:
    """Meta-arguments. Autotuning is keyed on the key length's power-of-two bucket, not the
    exact lengths: a serving engine's prefill chunks come in every length, and re-tuning
    for each would stall it."""
    head_dim = q.shape[-1]
    return {"LENGTH_BUCKET": triton.next_power_of_2(seq_k), "HEAD_DIM": head_dim,
            "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
            "PRECISION": dot_precision(q.dtype), "DOCUMENTS": documents}


def _document_ends(starts: Tensor) -> Tensor:
    """(B, T) document starts -> one past the last index of each token's document."""
    seq = starts.shape[1]
    index = torch.arange(seq, device=starts.device).expand_as(starts)
    last = torch.ones_like(starts, dtype=torch.bool)
    last[:, :-1] = starts[:, 1:] != starts[:, :-1]
    ends = torch.where(last, index + 1, seq)
    return ends.flip(1).cummin(dim=1).values.flip(1)


def _forward_triton(q: Tensor, k: Tensor, v: Tensor, starts: Tensor,
                    documents: bool) -> tuple[Tensor, Tensor]:
    batch, n_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_k = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, n_heads, seq_q, dtype=torch.float32, device=q.device)

    def grid(meta):
        return triton.cdiv(seq_q, meta["BLOCK_M"]), batch * n_heads
    _forward[grid](q, k, v, out, lse, starts, head_dim ** -0.5, seq_q, seq_k, n_heads,
                   n_heads // n_kv_heads, *_strides(q), *_strides(k), *_strides(v),
                   **_launch_args(q, seq_k, documents))
    return out, lse


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, starts: Tensor,
                documents: bool) -> Tensor:
        out, lse = _forward_triton(q, k, v, starts, documents)
        ctx.save_for_backward(q, k, v, out, lse, starts)
        ctx.documents = documents
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, lse, starts = ctx.saved_tensors
        batch, n_heads, seq_q, head_dim = q.shape
        n_kv_heads, seq_k = k.shape[1], k.shape[2]
        q, grad_out = q.contiguous(), grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # rowsum(dO ∘ O), the softmax term
        dq = torch.empty_like(q)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        scale, group = head_dim ** -0.5, n_heads // n_kv_heads
        documents = ctx.documents
        ends = _document_ends(starts) if documents else starts
        args = _launch_args(q, seq_k, documents)
        _backward_dq[lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * n_heads)](
            q, k, v, grad_out, lse, delta, dq, starts, scale, seq_q, seq_k, n_heads, group,
            *_strides(k), *_strides(v), **args)
        _backward_dkdv[lambda meta: (triton.cdiv(seq_k, meta["BLOCK_N"]), batch * n_kv_heads)](
            q, k, v, grad_out, lse, delta, dk, dv, starts, ends, scale, seq_q, seq_k, n_heads,
            n_kv_heads, group, *_strides(k), *_strides(v), **args)
        return dq, dk, dv, None, None


def causal_attention_triton(q: Tensor, k: Tensor, v: Tensor,
                            document_starts: Tensor | None = None) -> Tensor:
    """Causal attention of (B, H, Sq, D) q over (B, Hkv, Sk, D) k, v; with (B, T)
    `document_starts` (square only) each query sees keys of its own document alone."""
    check_shapes(q, k, v, document_starts)
    documents = document_starts is not None
    starts = (document_starts.to(torch.int32).contiguous() if documents
              else torch.zeros(1, dtype=torch.int32, device=q.device))  # never read
    return _CausalAttention.apply(q, k, v, starts, documents)
