"""Causal attention for training and prefill, FlashAttention-2 style: each program owns a
tile of query rows of one head and streams the keys and values of its KV head through
an online softmax, so the (queries × keys) score matrix never exists. GQA maps query head
h to KV head h // (n_heads / n_kv_heads).

Queries are the last `seq_q` of `seq_k` positions (bottom-right causal alignment, as
flash-attn ≥ 2.1): query i sees keys 0 … i + seq_k − seq_q. That one rule covers training
(seq_q = seq_k) and a prefill chunk that follows cached context (seq_q < seq_k).

Packed rows hold several documents, each a contiguous run of the row; `document_starts`
(B, T), each token's document's first index (`document_starts(documents)`), confines every
query to its own document, as FlashAttention's varlen form does for concatenated sequences.

The backward follows FlashAttention-2 too: the forward saves each row's log-sum-exp, one
kernel walks the query tiles per key tile to accumulate dK and dV (over every query head
of the KV group, so GQA needs no atomics), another walks key tiles per query tile for dQ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lathe.kernels.dispatch import check_same_dtype, use_triton


@dataclass(frozen=True)
class AttentionVariant:
    """How a layer's attention departs from plain causal softmax(q·kᵀ/√d)·v, as open-model
    families do (the kernels take only the plain form; any variant takes the reference).

    - `window`: sliding-window attention: a query sees itself and the `window - 1` keys
      before it (transformers' `kv_idx > q_idx - sliding_window`; Mistral, Gemma, Phi-3);
    - `scale`: the score scale, None for 1/√head_dim (Gemma: query_pre_attn_scalar^-½);
    - `softcap`: scores become softcap·tanh(scores/softcap) before the mask (Gemma 2).
    """

    window: int | None = None
    scale: float | None = None
    softcap: float | None = None


PLAIN = AttentionVariant()


def visible(query_pos: Tensor, key_pos: Tensor, window: int | None) -> Tensor:
    """Which keys each query sees: (..., Sq, 1) query positions against (..., Sk) key
    positions -> a bool mask: causal, and within the window when there is one."""
    mask = key_pos <= query_pos
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    return mask


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                     variant: AttentionVariant) -> Tensor:
    """Attention of (B, H, Sq, D) queries over (B, Hkv, Sk, D) keys under a boolean `mask`
    broadcast to (B, H, Sq, Sk): SDPA, or without it when scores are soft-capped (computed
    as transformers' eager attention does: scores in the input dtype, softmax in fp32)."""
    if variant.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=variant.scale,
                                              enable_gqa=grouped(q, k))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = variant.scale if variant.scale is not None else q.shape[-1] ** -0.5
    scores = q @ k.transpose(-1, -2) * scale
    scores = torch.tanh(scores / variant.softcap) * variant.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def grouped(q: Tensor, k: Tensor) -> bool:
    """Whether (B, H, ...) queries share (B, Hkv, ...) KV heads (SDPA's `enable_gqa`), as a
    plain bool: under torch.compile's dynamic shapes the comparison is a SymBool, which
    SDPA refuses; branching on it makes dynamo guard on the head counts instead."""
    return True if q.shape[1] != k.shape[1] else False  # noqa: SIM210


def document_starts(documents: Tensor) -> Tensor:
    """(B, T) document ids, each document one contiguous run of its row -> (B, T) the index
    of the first token of each token's document."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return torch.where(first, index, 0).cummax(dim=1).values


def causal_attention_reference(q: Tensor, k: Tensor, v: Tensor,
                               variant: AttentionVariant = PLAIN,
                               document_starts: Tensor | None = None) -> Tensor:
    """(B, H, Sq, D) queries over (B, Hkv, Sk, D) keys and values, Sk ≥ Sq -> (B, H, Sq, D).
    With `document_starts` (square only) the mask is also block-diagonal per document: on
    CPU SDPA's flash kernel takes the boolean mask."""
    seq_q, seq_k = q.shape[2], k.shape[2]
    window = variant.window if variant.window is not None and variant.window < seq_k else None
    if document_starts is not None:
        pos = torch.arange(seq_q, device=q.device)
        mask = visible(pos[:, None], pos, window) & (pos >= document_starts[:, :, None])
        return masked_attention(q, k, v, mask[:, None], variant)
    if seq_q == seq_k and window is None and variant.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=variant.scale,
                                              enable_gqa=grouped(q, k))
    query_pos = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q)
    mask = visible(query_pos, torch.arange(seq_k, device=q.device), window)
    return masked_attention(q, k, v, mask, variant)


def check_shapes(q: Tensor, k: Tensor, v: Tensor,
                 document_starts: Tensor | None = None) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"causal_attention takes q (B, H, Sq, D) and k, v (B, Hkv, Sk, D); "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or q.shape[2] > k.shape[2]:
        raise ValueError(f"causal_attention needs H divisible by Hkv and Sq ≤ Sk; got "
                         f"H={q.shape[1]}, Hkv={k.shape[1]}, Sq={q.shape[2]}, Sk={k.shape[2]}")
    if document_starts is not None and (q.shape[2] != k.shape[2] or document_starts.shape
                                        != (q.shape[0], q.shape[2])):
        raise ValueError(f"document_starts {tuple(document_starts.shape)} must be (B, T) of "
                         f"square attention; got q {tuple(q.shape)}, k {tuple(k.shape)}")


def causal_attention(q: Tensor, k: Tensor, v: Tensor, variant: AttentionVariant = PLAIN,
                     document_starts: Tensor | None = None) -> Tensor:
    """Causal attention of the last Sq positions over Sk keys (a family's `variant`: a
    sliding window, another scale, soft-capped scores; those take the reference), within
    each query's document when `document_starts` is given (packed rows).

    Square causal attention (training, a first prefill) takes SDPA everywhere: its
    FlashAttention backend beats the kernel (807 vs 1,326 µs forward+backward in bf16 on an
    H200; docs/benchmarks.md). Two cases may take the Triton kernel on CUDA, each under its
    own name in the defaults table: a chunk after cached context (Sq < Sk: chunked prefill,
    verification of drafts; `causal_attention`), where SDPA needs an explicit mask, and
    packed rows (`document_attention`), where the kernel skips the tiles between documents
    that masked SDPA computes."""
    check_same_dtype("causal_attention", q=q, k=k, v=v)
    if document_starts is not None:
        check_shapes(q, k, v, document_starts)
        kernel = "document_attention"
    else:
        kernel = "causal_attention" if q.shape[2] < k.shape[2] else None
    if variant == PLAIN and kernel is not None and use_triton(kernel, q):
        from lathe.kernels.attention_triton import causal_attention_triton
        return causal_attention_triton(q, k, v, document_starts)
    return causal_attention_reference(q, k, v, variant, document_starts)
