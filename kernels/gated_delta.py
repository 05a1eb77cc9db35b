"""The gated delta rule (Gated DeltaNet, Yang et al. 2024: Qwen3.5's and Qwen3-Next's linear
attention) and the short causal convolution before it, in PyTorch.

Per value head, a (Dk, Dv) state S is decayed by exp(g_t), corrected toward the new value
along the key (the delta rule, learning rate β_t) and read by the query:

    S_t = exp(g_t) · S_{t-1}
    S_t = S_t + β_t · k_t (v_t − S_tᵀ k_t)ᵀ
    o_t = S_tᵀ q_t

with q and k L2-normalized (x / √(Σx² + 1e-6), flash-linear-attention's form) and q scaled by
Dk^-½. `gated_delta_rule` computes it chunk by chunk (the UT form: within a chunk a
triangular solve and matmuls, across chunks the state), `gated_delta_recurrence` token by
token (a decode step, and the reference the chunked form is checked against). Both take
packed rows: `starts` (each token's document's first index, `document_starts`) makes each
document begin from a zero state, as if alone — the chunked form masks every decay that
would cross a document's start, exactly, rather than forcing a decay to zero. Query/key heads
serve consecutive groups of value heads. The arithmetic is float32 whatever the inputs, as
flash-linear-attention keeps it; outputs come back in v's dtype, states in float32.

`short_convolution` is the depthwise causal convolution (and SiLU) over q, k and v before the
rule, also packed-aware, carrying its last inputs as a decode state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def _prepared(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(B, T, H, D) inputs as float32 (B, Hv, T, D): q and k normalized (q scaled) and
    repeated over their value heads; g and beta (B, T, Hv) as (B, Hv, T)."""
    groups = v.shape[2] // k.shape[2]
    if groups * k.shape[2] != v.shape[2]:
        raise ValueError(f"{v.shape[2]} value heads are not a multiple of {k.shape[2]} key "
                         "heads")
    q, k = _l2norm(q.float()), _l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    return (q.transpose(1, 2), k.transpose(1, 2), v.float().transpose(1, 2),
            g.float().transpose(1, 2), beta.float().transpose(1, 2))


def gated_delta_recurrence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           starts: Tensor | None = None, state: Tensor | None = None,
                           every: bool = False) -> tuple[Tensor, Tensor]:
    """The rule token by token: q, k (B, T, Hk, Dk), v (B, T, Hv, Dv), g (log decay, ≤ 0)
    and beta (B, T, Hv), the state (B, Hv, Dk, Dv) before the first token (None: zeros) ->
    the output (B, T, Hv, Dv) and the state after the last token — or, with `every`, after
    each token (B, T, Hv, Dk, Dv): a speculative step's, to keep the one after its last
    accepted token."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepared(q, k, v, g, beta)
    batch, heads, length, _ = v.shape
    s = q.new_zeros(batch, heads, k.shape[-1], v.shape[-1]) if state is None else state.float()
    out = torch.empty_like(v)
    after = [] if every else None
    for t in range(length):
        decay = g[:, :, t].exp()
        if starts is not None:  # a document's first token forgets the one before
            decay = torch.where((starts[:, t] == t)[:, None], 0.0, decay)
        s = s * decay[..., None, None]
        delta = (v[:, :, t] - (s * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[:, :, None]
        out[:, :, t] = (s * q[:, :, t, :, None]).sum(-2)
        if after is not None:
            after.append(s)
    return out.transpose(1, 2).to(out_dtype), s if after is None else torch.stack(after, 1)


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     starts: Tensor | None = None, state: Tensor | None = None,
                     chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """`gated_delta_recurrence`'s result, computed `chunk` tokens at a time (fewer for a
    shorter sequence: the power of two that holds it, so a prefill's last few tokens do not
    pay a whole chunk's padding)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepared(q, k, v, g, beta)
    batch, heads, length, dv = v.shape
    chunk = min(chunk, 1 << max(length - 1, 0).bit_length())
    dk = k.shape[-1]
    pad = -length % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        if starts is not None:  # the padding continues the last document
            starts = torch.cat((starts, starts[:, -1:].expand(-1, pad)), dim=1)
    n = (length + pad) // chunk
    q, k, v = (x.reshape(batch, heads, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(batch, heads, n, chunk), beta.reshape(batch, heads, n, chunk)
    cum = g.cumsum(-1)
    below = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # which decays a document's start cuts: within a chunk, between tokens of two documents;
    # the state carried into a chunk, from tokens whose document began in it; the state
    # carried out, to tokens of a document the chunk's last token is not in
    if starts is None:
        same = below
        reads_state = writes_state = carries = None
    else:
        starts = starts.reshape(batch, 1, n, chunk)
        same = below & (starts[..., :, None] == starts[..., None, :])
        first = (torch.arange(n, device=q.device) * chunk)[:, None]  # each chunk's first index
        reads_state = (starts < first).float()
        writes_state = (starts == starts[..., -1:]).float()
        carries = reads_state[..., -1]
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(~same, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    from_start = cum.exp() if reads_state is None else cum.exp() * reads_state
    to_end = (cum[..., -1:] - cum).exp() if writes_state is None else \
        (cum[..., -1:] - cum).exp() * writes_state
    chunk_decay = cum[..., -1].exp() if carries is None else cum[..., -1].exp() * carries
    strictly = (k_beta @ k.transpose(-1, -2)) * pairwise
    # (I + strictly lower) X = ...: the delta rule's corrections within the chunk
    new_values = torch.linalg.solve_triangular(strictly, v_beta, upper=False, unitriangular=True)
    k_read = torch.linalg.solve_triangular(strictly, k_beta * from_start[..., None],
                                           upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * pairwise
    q_read = q * from_start[..., None]
    k_write = k * to_end[..., None]
    s = q.new_zeros(batch, heads, dk, dv) if state is None else state.float()
    out = torch.empty_like(v)
    for i in range(n):
        fresh = new_values[:, :, i] - k_read[:, :, i] @ s
        out[:, :, i] = q_read[:, :, i] @ s + attn[:, :, i] @ fresh
        s = s * chunk_decay[:, :, i, None, None] + k_write[:, :, i].transpose(-1, -2) @ fresh
    out = out.reshape(batch, heads, n * chunk, dv)[:, :, :length].transpose(1, 2)
    return out.to(out_dtype), s


def short_convolution(x: Tensor, weight: Tensor, starts: Tensor | None = None,
                      state: Tensor | None = None, every: bool = False
                      ) -> tuple[Tensor, Tensor]:
    """SiLU of the depthwise causal convolution of x (B, T, C) by weight (C, K): token t
    reads tokens t−K+1..t of its own document (`starts`), and before the first token the
    K−1 inputs of `state` (B, K−1, C; None: zeros). Returns it and the last K−1 inputs —
    with `every`, those up to each token, it included (B, T, K−1, C)."""
    width = weight.shape[1]
    history = x.new_zeros(x.shape[0], width - 1, x.shape[2]) if state is None \
        else state.to(x.dtype)
    padded = torch.cat((history, x), dim=1)
    length = x.shape[1]
    out = padded[:, width - 1:] * weight[:, -1]
    position = torch.arange(length, device=x.device)
    for back in range(1, width):
        earlier = padded[:, width - 1 - back:width - 1 - back + length]
        if starts is not None:
            earlier = earlier * (position - back >= starts)[..., None].to(x.dtype)
        out = out + earlier * weight[:, width - 1 - back]
    after = padded.unfold(1, width - 1, 1)[:, 1:].transpose(2, 3) if every \
        else padded[:, length:]
    return F.silu(out).to(x.dtype), after
