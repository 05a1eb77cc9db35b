"""Causal attention (interpreter) against SDPA: forward and the three gradients, fp32 and
fp16; GQA ratios 1, 4 and 8; lengths that are not tile multiples, a single query, a head
size that is not a power of two, queries strided as the model makes them, and a prefill
chunk after cached context (Sq < Sk, bottom-right causal); packed rows of documents
(each query within its own document). Tolerances (fp32 reference on
the same inputs): fp32 1e-5 (abs and rel); fp16 2e-3 forward, 1e-2 gradients; bf16
1.5e-2 forward (vLLM's bound), 5e-2 gradients."""

from __future__ import annotations

import pytest
import torch

from lathe.kernels.attention import causal_attention, causal_attention_reference, document_starts
from lathe.kernels.attention_triton import causal_attention_triton
from lathe.kernels.dispatch import kernels_off
from tests.kernels.target import DEVICE, DTYPES, enable_kernels

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-2),
             torch.bfloat16: (1.5e-2, 5e-2)}


def qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # (B, S, H, D) transposed to (B, H, S, D): the layout Attention.forward hands over
    q = torch.randn(batch, seq_q, heads, head_dim, generator=g).transpose(1, 2)
    k = torch.randn(batch, seq_k, kv_heads, head_dim, generator=g).transpose(1, 2)
    v = torch.randn(batch, kv_heads, seq_k, head_dim, generator=g)
    q, k, v = (t.to(DEVICE, dtype) for t in (q, k, v))
    return [t.detach().requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, heads, kv_heads, seq_q, seq_k, head_dim", [
    (2, 4, 4, 37, 37, 32),    # MHA, length not a tile multiple
    (1, 8, 2, 70, 70, 24),    # GQA 4, head size not a power of two
    (1, 8, 1, 65, 65, 64),    # MQA (GQA 8), one row past a 64-row tile
    (2, 4, 1, 1, 1, 16),      # a single token
    (1, 8, 2, 20, 70, 32),    # a prefill chunk after 50 cached tokens
    (1, 4, 4, 1, 33, 32),     # one query over a cached context: decode through prefill
])
def test_causal_attention_matches_sdpa(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype):
    forward_tol, grad_tol = TOLERANCE[dtype]
    q, k, v = qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype)
    ours = causal_attention_triton(q, k, v)
    ref = causal_attention_reference(*(t.float() for t in (q, k, v)))
    torch.testing.assert_close(ours.float(), ref, atol=forward_tol, rtol=forward_tol)
    upstream = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    upstream = upstream.to(DEVICE, dtype)
    for ours_grad, ref_grad in zip(torch.autograd.grad(ours, (q, k, v), upstream),
                                   torch.autograd.grad(ref, (q, k, v), upstream.float()),
                                   strict=True):
        torch.testing.assert_close(ours_grad.float(), ref_grad.float(), atol=grad_tol,
                                   rtol=grad_tol)


def row_documents(*rows: tuple[int, ...]) -> torch.Tensor:
    """(B, T) document ids from each row's document lengths."""
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])
                        for row in rows]).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, lengths", [
    (4, 4, ((5, 30, 2, 33), (70,))),        # documents across 64-row tiles; one whole row
    (8, 2, ((1, 1, 64, 4), (40, 29, 1))),   # single tokens, one exactly a tile; GQA 4
    (4, 1, ((100, 3, 27), (7,) * 18 + (4,))),  # MQA; many short documents in a row
])
def test_packed_documents_match_each_document_alone(heads, kv_heads, lengths, dtype):
    """With document starts, each document of a packed row gets exactly its own causal
    attention and its own gradients, as if it were alone."""
    forward_tol, grad_tol = TOLERANCE[dtype]
    documents = row_documents(*lengths)
    batch, seq = documents.shape
    q, k, v = qkv(batch, heads, kv_heads, seq, seq, 16, dtype)
    ours = causal_attention_triton(q, k, v, document_starts(documents))
    upstream = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    upstream = upstream.to(DEVICE, dtype)
    grads = torch.autograd.grad(ours, (q, k, v), upstream)
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            piece = slice(start, start + n)
            alone = [t[b:b + 1, :, piece].float().detach().requires_grad_() for t in (q, k, v)]
            ref = causal_attention_reference(*alone)
            torch.testing.assert_close(ours[b:b + 1, :, piece].float(), ref, atol=forward_tol,
                                       rtol=forward_tol)
            ref_grads = torch.autograd.grad(ref, alone, upstream[b:b + 1, :, piece].float())
            for grad, ref_grad in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(grad[b:b + 1, :, piece].float(), ref_grad,
                                           atol=grad_tol, rtol=grad_tol)
            start += n


def test_document_reference_and_dispatch(monkeypatch):
    """The masked reference confines queries to their documents as the kernel does, and
    packed rows take the kernel when it is enabled; a non-square call is refused."""
    import lathe.kernels.attention_triton as attention_triton
    documents = row_documents((3, 9, 12))
    q, k, v = qkv(1, 4, 2, 24, 24, 16, torch.float32)
    starts = document_starts(documents)
    assert starts.tolist() == [[0] * 3 + [3] * 9 + [12] * 12]
    expected = torch.cat([causal_attention_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
                          for a, b in ((0, 3), (3, 12), (12, 24))], dim=2)
    torch.testing.assert_close(causal_attention(q, k, v, document_starts=starts), expected)
    enable_kernels(monkeypatch)
    calls = []
    kernel = attention_triton.causal_attention_triton
    monkeypatch.setattr(attention_triton, "causal_attention_triton",
                        lambda *args: calls.append(len(args)) or kernel(*args))
    torch.testing.assert_close(causal_attention(q, k, v, document_starts=starts), expected,
                               atol=1e-5, rtol=1e-5)
    assert calls == [4]
    with pytest.raises(ValueError, match="square attention"):
        causal_attention(q[:, :, 4:], k, v, document_starts=starts)


def test_reference_is_bottom_right_causal():
    """The last Sq of Sk positions: query i sees keys up to i + Sk - Sq, so attention over a
    prefix plus a chunk equals the matching rows of attention over the whole sequence."""
    q, k, v = qkv(1, 4, 2, 30, 30, 16, torch.float32)
    whole = causal_attention(q, k, v)
    torch.testing.assert_close(causal_attention(q[:, :, 18:], k, v), whole[:, :, 18:])


def test_square_attention_takes_sdpa_and_chunks_after_context_take_the_kernel(monkeypatch):
    """SDPA's flash backend beat the kernel on square causal attention on an H100, so the
    dispatch sends only Sq < Sk (a chunk after cached context) to Triton."""
    import lathe.kernels.attention as attention
    import lathe.kernels.attention_triton as attention_triton
    enable_kernels(monkeypatch)
    calls = []
    kernel = attention_triton.causal_attention_triton
    monkeypatch.setattr(attention_triton, "causal_attention_triton",
                        lambda q, *rest: calls.append(q.shape[2]) or kernel(q, *rest))
    q, k, v = qkv(1, 4, 2, 12, 12, 16, torch.float32)
    attention.causal_attention(q, k, v)
    assert calls == []
    attention.causal_attention(q[:, :, 8:], k, v)
    assert calls == [4]


def test_mismatched_shapes_are_refused_with_the_rule():
    q, k, v = qkv(1, 4, 3, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="H divisible by Hkv"):
        causal_attention_triton(q, k, v)
    q, k, v = qkv(1, 4, 2, 9, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="Sq ≤ Sk"):
        causal_attention_triton(q, k, v)


def test_model_prefill_chunks_and_decode_through_the_kernel_match_kernels_off(monkeypatch):
    """The contiguous cache hands each chunk to causal_attention with Sq < Sk."""
    from lathe.model.kv_cache import ContiguousKVCache
    from tests.builders import tiny_model
    model = tiny_model(n_kv_heads=1).to(DEVICE)  # GQA 4
    ids = torch.randint(0, 256, (2, 30), device=DEVICE)
    with torch.no_grad(), kernels_off():
        full = model(ids).logits
    enable_kernels(monkeypatch)
    cache = ContiguousKVCache(model.config, 2, 30, device=DEVICE)
    with torch.no_grad():
        chunks = [model(ids[:, a:b], kv_cache=cache).logits
                  for a, b in ((0, 11), (11, 12), (12, 25), (25, 30))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)


def test_packed_rows_and_chunks_after_context_are_switched_by_their_own_names(monkeypatch):
    """Each case the kernel takes has its own entry (measured apart): turning one off leaves
    the other on the kernel."""
    import lathe.kernels.attention_triton as attention_triton
    enable_kernels(monkeypatch)
    calls = []
    kernel = attention_triton.causal_attention_triton
    monkeypatch.setattr(attention_triton, "causal_attention_triton",
                        lambda *args: calls.append("packed" if args[3] is not None
                                                   else "chunk") or kernel(*args))
    q, k, v = qkv(1, 4, 2, 24, 24, 16, torch.float32)
    starts = document_starts(row_documents((3, 9, 12)))
    with kernels_off("document_attention"):
        causal_attention(q, k, v, document_starts=starts)
        causal_attention(q[:, :, 8:], k, v)
    assert calls == ["chunk"]
    with kernels_off("causal_attention"):
        causal_attention(q, k, v, document_starts=starts)
        causal_attention(q[:, :, 8:], k, v)
    assert calls == ["chunk", "packed"]


@pytest.mark.parametrize("kernels", ["0", "force"])
def test_mixed_dtypes_are_refused_on_every_device(kernels, monkeypatch):
    """`tl.dot` refuses bf16 q against fp32 k/v on a GPU; the dispatch refuses it everywhere,
    so a CPU test catches the mix (it crashed the first GPU pretraining eval)."""
    monkeypatch.setenv("LATHE_KERNELS", kernels)
    q = torch.randn(1, 2, 4, 16, dtype=torch.bfloat16)
    k = v = torch.randn(1, 1, 4, 16)
    with pytest.raises(TypeError, match="causal_attention needs one dtype for q, k, v; got "
                                        "q bfloat16, k float32, v float32"):
        causal_attention(q, k, v)


def test_gqa_references_trace_whole_under_dynamic_shapes():
    """torch.compile(dynamic=True) sees the head counts as symbols; SDPA's enable_gqa must
    still get a plain bool, or the graph breaks (a compiled forward then falls back)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    traced = torch.compile(causal_attention_reference, backend="eager", fullgraph=True,
                           dynamic=True)
    torch.testing.assert_close(traced(q, k, v), causal_attention_reference(q, k, v))
    square = torch.randn(1, 2, 6, 8)
    torch.testing.assert_close(traced(q, square, square),
                               causal_attention_reference(q, square, square))


def naive_attention(q, k, v, window=None, scale=None, softcap=None):
    """Attention written out score by score (bottom-right causal, GQA by repetition)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    seq_q, seq_k = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = torch.arange(seq_q)[:, None] + seq_k - seq_q
    key_pos = torch.arange(seq_k)[None]
    seen = (key_pos <= query_pos) & ((key_pos > query_pos - window) if window else True)
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("variant", [
    dict(window=8), dict(scale=0.3), dict(softcap=2.0), dict(window=5, scale=0.2, softcap=3.0),
    dict(window=100)], ids=["window", "scale", "softcap", "all-three", "window-past-context"])
@pytest.mark.parametrize("seq_q", [40, 9, 1])
def test_attention_variants_are_what_their_scores_say(variant, seq_q):
    """Sliding window, another scale, soft-capped scores (open-model families): the
    training/prefill path and the paged decode path both equal the naive formula, for a whole
    sequence, a chunk after cached context and one decoded token."""
    from lathe.kernels import AttentionVariant, paged_decode
    q, k, v = (t.detach().cpu().float() for t in qkv(2, 4, 2, seq_q, 40, 16, torch.float32))
    expected = naive_attention(q, k, v, **variant)
    chosen = AttentionVariant(**variant)
    torch.testing.assert_close(causal_attention(q, k, v, chosen), expected)
    if seq_q == 1:  # the same tokens through block tables: blocks of 4, in shuffled order
        order = torch.randperm(20, generator=torch.Generator().manual_seed(0))
        tables = order.view(2, 10)  # sequence b's 40 keys sit in blocks tables[b]
        rows = (tables[..., None] * 4 + torch.arange(4)).flatten(1)  # (2, 40) slab rows
        k_slab, v_slab = torch.zeros(80, 2, 16), torch.zeros(80, 2, 16)
        k_slab[rows], v_slab[rows] = k.transpose(1, 2), v.transpose(1, 2)
        out = paged_decode(q[:, :, 0], k_slab, v_slab, tables, torch.tensor([40, 40]), 4,
                           chosen)
        torch.testing.assert_close(out, expected[:, :, 0])
