"""Causal attention for training and prefill, FlashAttention-2 style: each program owns a
tile of query rows of one head and streams the keys and values of its KV head through
an online softmax, so the (queries × keys) score matrix never exists. GQA maps query head
h to KV head h // (n_heads / n_kv_heads).

Queries are the last `seq_q` of `seq_k` positions (bottom-right causal alignment, as
flash-attn ≥ 2.1): query i sees keys 0 … i + seq_k − seq_q. That one rule covers training
(seq_q = seq_k) and a prefill chunk that follows cached context (seq_q < seq_k).

The backward follows FlashAttention-2 too: the forward saves each row's log-sum-exp, one
kernel walks the query tiles per key tile to accumulate dK and dV (over every query head
of the KV group, so GQA needs no atomics), another walks key tiles per query tile for dQ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lathe.kernels.dispatch import check_same_dtype, use_triton


def grouped(q: Tensor, k: Tensor) -> bool:
    """Whether (B, H, ...) queries share (B, Hkv, ...) KV heads (SDPA's `enable_gqa`), as a
    plain bool: under torch.compile's dynamic shapes the comparison is a SymBool, which
    SDPA refuses; branching on it makes dynamo guard on the head counts instead."""
    return True if q.shape[1] != k.shape[1] else False  # noqa: SIM210


def causal_attention_reference(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """(B, H, Sq, D) queries over (B, Hkv, Sk, D) keys and values, Sk ≥ Sq -> (B, H, Sq, D)."""
    seq_q, seq_k = q.shape[2], k.shape[2]
    gqa = grouped(q, k)
    if seq_q == seq_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    query_pos = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q)
    mask = torch.arange(seq_k, device=q.device)[None] <= query_pos
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"causal_attention takes q (B, H, Sq, D) and k, v (B, Hkv, Sk, D); "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or q.shape[2] > k.shape[2]:
        raise ValueError(f"causal_attention needs H divisible by Hkv and Sq ≤ Sk; got "
                         f"H={q.shape[1]}, Hkv={k.shape[1]}, Sq={q.shape[2]}, Sk={k.shape[2]}")


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of the last Sq positions over Sk keys.

    A chunk after cached context (Sq < Sk: chunked prefill, verification of drafts) may
    take the Triton kernel on CUDA, where SDPA needs an explicit mask; the defaults table
    leaves it off until that case is measured (`LATHE_KERNELS_ENABLE=causal_attention`).
    Square causal attention (training, a first prefill) takes SDPA everywhere: its
    FlashAttention backend beat the kernel on an H100 (852 vs 1,376 µs forward+backward in
    bf16; docs/benchmarks.md)."""
    check_same_dtype("causal_attention", q=q, k=k, v=v)
    if q.shape[2] < k.shape[2] and use_triton("causal_attention", q):
        from lathe.kernels.attention_triton import causal_attention_triton
        return causal_attention_triton(q, k, v)
    return causal_attention_reference(q, k, v)
