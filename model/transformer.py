"""The decoder-only transformer every lathe stage trains, exports and serves.

Llama architecture: token embedding, pre-norm blocks (RMSNorm, causal self-attention
with rotary position embeddings and grouped KV heads, residual; RMSNorm, SwiGLU MLP,
residual), a final RMSNorm and an LM head that may share the embedding matrix — or, for a
sequence classifier such as a reward model (`ModelConfig.num_labels`), HF's `score` head.

Module and parameter names mirror Hugging Face's `LlamaForCausalLM`
(`model.layers.0.self_attn.q_proj.weight`, ...) and RoPE uses its rotate-half layout,
so a state dict from this module *is* an HF Llama checkpoint. The file is
single-device and precision-agnostic: parallelism, mixed precision and FP8 are
applied from outside by the training runtime. RMSNorm (also fused with the residual
add) and SwiGLU go through `lathe.kernels`, which runs Triton on CUDA and the PyTorch
reference elsewhere; so does RoPE. The open-model families' departures from Llama are
switches of `ModelConfig`, and so is a mixture of experts: an `MoE` MLP (a softmax or
sigmoid router and stacked experts run as grouped GEMMs) in the layers the config names,
whose routing statistics come back beside the logits (`RouterStats`) and whose balance loss
the training loss includes; so is a layer whose token mixer is not attention but a Gated
DeltaNet (`lathe.model.gated_delta_net`, Qwen3.5's linear attention).

Initialization (`Transformer.init_weights`): embeddings and every linear weight
~ N(0, init_std), except the two projections that write into the residual stream
(`o_proj`, `down_proj`) which use init_std / sqrt(2 * n_layers) (GPT-2) so the
residual's variance does not grow with depth; RMSNorm weights are ones. A model built
on the meta device is left uninitialized: whoever materializes it (checkpoint loading,
sharded training) fills it and calls `init_weights` if it needs fresh values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lathe.kernels import (
    AttentionVariant,
    add_rms_norm,
    causal_attention,
    configure_kernels,
    document_starts,
    linear_cross_entropy,
    rms_norm,
    rope,
    swiglu,
)
from lathe.kernels.grouped_matmul import grouped_matmul
from lathe.model.config import ModelConfig, RopeScaling
from lathe.model.gated_delta_net import GatedDeltaNet, GatedRMSNorm
from lathe.model.kv_cache import KVCache

IGNORE_INDEX = -100


class CausalLMOutput(NamedTuple):
    logits: Tensor | None
    loss: Tensor | None  # with labels; a mixture of experts adds its router losses
    router: RouterStats | None = None  # a mixture of experts' routing (see forward)
    hidden: Tensor | None = None  # with head=False: the final norm's output
    z: Tensor | None = None  # with labels: mean squared log-normalizer of the scored rows
    head: Any = None  # with a head_op: what it computed


class HeadOp(Protocol):
    """What a training stage computes from the LM head's output, given to the forward so
    that it runs where the head's weight is (inside the model's forward, as its wrappers
    expect): `chunked` from the final hidden states (B, T, dim), the head's (vocab, dim)
    weight and its soft cap, never holding the (B, T, vocab) logits; `from_logits` the same
    from the logits, when the head is sharded or adapted."""

    def chunked(self, hidden: Tensor, weight: Tensor, softcap: float | None) -> Any: ...

    def from_logits(self, logits: Tensor) -> Any: ...


class RouterStats(NamedTuple):
    """A mixture of experts' routing in one forward, over its MoE layers: the
    load-balancing loss (transformers' `load_balancing_loss_func`; None for a sigmoid router,
    whose families have none), the router z-loss, how many token-expert assignments each
    expert of each MoE layer took (`layer_load`, (MoE layers, E)), as routed — with a
    sigmoid router's selection bias — and what training adds to its loss (`loss`): the
    balance loss times `router_aux_loss_coef` when `router_aux_loss` (transformers adds it
    alike, with `output_router_logits`; TRL's trainers with their `router_aux_loss_coef`)
    and the z-loss times `router_z_loss_coef`. The balance loss is computed either way."""

    aux_loss: Tensor | None
    z_loss: Tensor
    layer_load: Tensor
    loss: Tensor | float = 0.0

    @property
    def load(self) -> Tensor:
        """Each expert's share of all layers' assignments (1/E each when balanced)."""
        total = self.layer_load.sum(dim=0)
        return total / total.sum()

    def metrics(self) -> dict[str, Tensor]:
        """What a training step logs: the losses and the most and least loaded expert's
        share of its layer's assignments times E (1 is even; 0 is an expert no token
        reached), over the layers. Routing is dropless — every token reaches its experts —
        so no dropped fraction exists."""
        share = self.layer_load / self.layer_load.sum(dim=1, keepdim=True) \
            * self.layer_load.shape[1]
        losses = {"router/z_loss": self.z_loss.detach()}
        if self.aux_loss is not None:
            losses["router/aux_loss"] = self.aux_loss.detach()
        return {**losses, "router/load_max": share.max(), "router/load_min": share.min()}


Routing = tuple[Tensor, Tensor]  # one MoE layer's router logits (T, E) and chosen experts (T, k)
# kept in fp32 whatever the weights' dtype, as transformers keeps them: the selection bias
# moves by steps of ~1e-3, which bf16 would round away
FP32_BUFFERS = ("e_score_correction_bias",)


def router_stats(routing: list[Routing], config: ModelConfig,
                 token_mask: Tensor | None = None) -> RouterStats:
    """Switch Transformer's balance loss E · Σ_e f_e · P_e (f_e: share of the top-k
    assignments to expert e, counted k per token; P_e: mean router probability), over the
    tokens of every MoE layer together, as transformers computes it (a softmax router's);
    ST-MoE's z-loss mean(logsumexp(logits)²); each layer's load from the experts it chose.
    `token_mask` (the routed tokens' flat order): only its tokens count, as transformers'
    attention_mask leaves a padded batch's pads out."""
    top_k = config.n_experts_per_token
    logits = torch.cat([layer_logits for layer_logits, _ in routing]).float()
    n, device = logits.shape[-1], logits.device
    # weights, not a selection: a masked mean keeps every shape static (torch.compile, and
    # the memory plan's fake tensors)
    weight = (torch.ones(routing[0][0].shape[0], device=device) if token_mask is None
              else token_mask.flatten().to(device=device, dtype=torch.float32))
    weights = weight.repeat(len(routing))
    counted = weights.sum().clamp(min=1)
    aux = None
    if not config.sigmoid_router:
        probs = torch.softmax(logits, dim=-1)
        chosen = probs.topk(top_k, dim=-1).indices
        counts = torch.zeros(n, device=device).index_add_(
            0, chosen.flatten(), weights.repeat_interleave(top_k))
        aux = n * (counts / counted * ((probs * weights[:, None]).sum(0) / counted)).sum()
    z = (torch.logsumexp(logits, dim=-1).pow(2) * weights).sum() / counted
    # index_add_, not bincount, whose output's length depends on the data (a graph break
    # under torch.compile, and no shape at all for the memory plan's fake tensors)
    layer_load = torch.stack([torch.zeros(n, device=device).index_add_(
        0, experts.flatten(), weight.repeat_interleave(experts.shape[-1]))
        for _, experts in routing])
    loss = config.router_z_loss_coef * z
    if aux is not None and config.router_aux_loss:
        loss = loss + config.router_aux_loss_coef * aux
    return RouterStats(aux, z, layer_load, loss)


def with_router_losses(loss: Tensor, router: RouterStats | None) -> Tensor:
    """A training loss plus a mixture of experts' router losses (`RouterStats.loss`)."""
    return loss if router is None else loss + router.loss


def routing_metrics(router: RouterStats | None) -> dict[str, Tensor]:
    """What a training step logs of a mixture of experts' routing (`RouterStats.metrics`);
    nothing for a dense model."""
    return {} if router is None else router.metrics()


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, cast back before the weight (as HF Llama);
    the computation is `lathe.kernels.rms_norm`. With `unit_offset` (Gemma) it scales by
    1 + weight, and the weight starts at zero."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps

    def scale(self) -> Tensor:
        """What the normalized activations are multiplied by."""
        return self.weight + 1 if self.unit_offset else self.weight

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.scale(), self.eps)


def rope_inv_freq(config: ModelConfig, device: torch.device | str | None = None,
                  long: bool = False) -> Tensor:
    """Inverse frequencies theta^(-2i/d), scaled as `config.rope_scaling` says.

    Llama-3 scaling leaves wavelengths shorter than original_len / high_freq_factor
    alone, divides those longer than original_len / low_freq_factor by `factor`, and
    interpolates smoothly in between. Linear divides them all; YaRN see `_yarn`. LongRoPE
    divides each by its own factor, the long ones with `long`.
    """
    d = config.rotary_dim
    inv_freq = 1.0 / config.rope_theta ** (
        torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d
    )
    if config.rope_proportion is not None:  # Gemma 4's: the first share turns, the rest not
        turning = int(config.rope_proportion * d // 2)
        inv_freq = torch.cat((inv_freq[:turning], inv_freq.new_zeros(d // 2 - turning)))
    s = config.rope_scaling
    if s is None or s.rope_type == "dynamic":  # dynamic NTK stretches per forward
        return inv_freq
    if s.rope_type == "longrope":
        factors = s.long_factor if long else s.short_factor
        return inv_freq / torch.tensor(factors, dtype=torch.float32, device=device)
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "yarn":
        return _yarn(inv_freq, s, d, config.rope_theta)
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    long_wave = wavelen > s.original_max_seq_len / s.low_freq_factor
    short_wave = wavelen < s.original_max_seq_len / s.high_freq_factor
    scaled = torch.where(long_wave, inv_freq / s.factor, interpolated)
    return torch.where(short_wave, inv_freq, scaled)


def _yarn(inv_freq: Tensor, s: RopeScaling, d: int, theta: float) -> Tensor:
    """YaRN's frequencies (as transformers computes them): the dimensions that turn more
    than `beta_fast` times over the original context keep their frequency, those that turn
    fewer than `beta_slow` times are divided by `factor`, and a linear ramp joins them."""
    def dimension(rotations: float) -> float:
        return d * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = dimension(s.beta_fast), dimension(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions, recomputed per forward from `inv_freq` (LongRoPE:
    from `long_inv_freq` instead when a position of the forward passes the original
    context, as transformers switches; dynamic NTK: from frequencies of a base stretched to
    the forward's length — both without a host sync)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        scaling = config.rope_scaling
        self.longrope = scaling is not None and scaling.rope_type == "longrope"
        self._register_frequencies(None)  # on the default device (meta under a meta init)
        self.scale = scaling.cos_sin_scale() if scaling is not None else 1.0

    def reset_parameters(self, device: torch.device | str | None = None) -> None:
        """Recompute the (non-persistent) frequency buffers, e.g. after meta-device init."""
        self._register_frequencies(self.inv_freq.device if device is None else device)

    def _register_frequencies(self, device: torch.device | str | None) -> None:
        for name, long in (("inv_freq", False), ("long_inv_freq", True))[:1 + self.longrope]:
            if torch.empty(0, device=device).is_meta:
                # placeholders until `reset_parameters` on the real device: arithmetic on
                # meta tensors imports torch._dynamo (~1.5 s a process)
                freqs = torch.empty(self.config.rotary_dim // 2, device=device)
            else:
                freqs = rope_inv_freq(self.config, device, long)
            self.register_buffer(name, freqs, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq
        scaling = self.config.rope_scaling
        if self.longrope:
            original = scaling.original_max_seq_len
            inv_freq = torch.where(positions.max() >= original, self.long_inv_freq, inv_freq)
        elif scaling is not None and scaling.rope_type == "dynamic":
            inv_freq = self._dynamic_inv_freq(positions.max() + 1, scaling)
        freqs = positions[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        if self.scale == 1.0:
            return angles.cos().to(dtype), angles.sin().to(dtype)
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


    def _dynamic_inv_freq(self, length: Tensor, scaling: RopeScaling) -> Tensor:
        """Dynamic NTK's frequencies for a forward whose longest row is `length` (a tensor:
        no host sync), in transformers' arithmetic; the plain ones up to the original
        context."""
        d, original = self.config.rotary_dim, scaling.original_max_seq_len
        stretch = scaling.factor * length.clamp(min=original) / original - (scaling.factor - 1)
        base = self.config.rope_theta * stretch ** (d / (d - 2))
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device=length.device).float() / d
        return torch.where(length > original, 1.0 / base ** exponents, self.inv_freq)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.n_heads
        self.n_kv_heads, self.head_dim = config.attention_shape(layer_idx)
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        # Gemma 4 E2B/E4B: a KV-sharing layer attends over an earlier layer's keys and values
        self.kv_source = config.kv_source(layer_idx)
        self.shares_kv = self.kv_source != layer_idx
        # while a dict (the forward without a KV cache sets it), a layer others share with
        # stores its keys and values in it; an attribute, as `MoE.sink` is, for the same reasons
        self.kv_sink: dict[int, tuple[Tensor, Tensor]] | None = None
        # Qwen3.5: q_proj's heads are each followed by as wide a gate on the output
        self.output_gate = config.attn_output_gate
        self.q_proj = nn.Linear(config.dim, q_dim * (1 + self.output_gate), bias=config.qkv_bias)
        self.k_proj = None if self.shares_kv else nn.Linear(config.dim, kv_dim,
                                                            bias=config.qkv_bias)
        # Gemma 4's full layers: the values are the keys' projection (before k's norm, RoPE)
        self.v_proj = None if config.k_is_v(layer_idx) or self.shares_kv else nn.Linear(
            config.dim, kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, config.dim, bias=config.o_bias)
        # Qwen3, Gemma 3: each head of q and k normalized on its own, before RoPE; OLMoE:
        # each whole projection, before it is split into heads
        self.per_head_norm = config.qk_norm
        # Gemma 4: each head of v normalized too, by a norm without weight
        self.norm_eps = config.norm_eps if config.v_norm else None
        widths = ((self.head_dim, self.head_dim) if config.qk_norm
                  else (q_dim, kv_dim) if config.qk_norm_projection else None)
        self.q_norm = None if widths is None else RMSNorm(widths[0], config.norm_eps,
                                                          config.norm_unit_offset)
        self.k_norm = None if widths is None or self.shares_kv else RMSNorm(
            widths[1], config.norm_eps, config.norm_unit_offset)
        self.clip_qkv = config.clip_qkv
        self.rotates = config.no_rope_layers is None or bool(config.no_rope_layers[layer_idx])
        window = config.window(layer_idx)
        self.rotary_dim = int(self.head_dim * config.partial_rotary_factor)
        # Gemma 3's sliding layers rotate with their own base
        self.local_rope = window is not None and config.rope_local_theta is not None
        scalar = config.query_pre_attn_scalar
        # a window as long as the context changes nothing: the plain form keeps the kernels
        self.variant = AttentionVariant(
            window=window if window is not None and window < config.max_seq_len else None,
            scale=None if scalar is None else scalar ** -0.5, softcap=config.attn_softcap)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache | None,
                starts: Tensor | None = None,
                shared_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """`shared_kv`: a KV-sharing layer's source keys and values, without a KV cache."""
        if self.shares_kv:
            return self._attend_shared(x, cos, sin, kv_cache, starts, shared_kv)
        batch, seq, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(batch, seq, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(batch, seq, -1), gate.reshape(batch, seq, -1)
        v = k if self.v_proj is None else self.v_proj(x)
        if self.q_norm is not None and not self.per_head_norm:
            q, k = self.q_norm(q).to(q.dtype), self.k_norm(k).to(k.dtype)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(batch, seq, self.n_heads, self.head_dim)
        k = k.view(batch, seq, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.per_head_norm:  # under autocast the fp32 weight
            q, k = self.q_norm(q).to(q.dtype), self.k_norm(k).to(k.dtype)  # would promote them
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(batch, seq, self.n_kv_heads, self.head_dim)
        if self.norm_eps is not None:
            v = F.rms_norm(v.float(), (self.head_dim,), eps=self.norm_eps).to(v.dtype)
        v = v.transpose(1, 2)
        q, k = self._rotate(q, k, cos, sin)
        if kv_cache is not None:
            out = kv_cache.attend(self.layer_idx, q, k, v, self.variant)
        else:
            if self.kv_sink is not None:
                self.kv_sink[self.layer_idx] = k, v
            out = causal_attention(q, k, v, self.variant, starts)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def _rotate(self, q: Tensor, k: Tensor | None, cos: Tensor,
                sin: Tensor) -> tuple[Tensor, Tensor | None]:
        """q and k (None: q alone) turned by RoPE, where this layer turns them."""
        if not self.rotates:
            return q, k
        if self.rotary_dim == self.head_dim:
            return rope(q, k, cos, sin)
        turned_q, turned_k = rope(q[..., :self.rotary_dim],  # Phi-3's: the first channels
                                  None if k is None else k[..., :self.rotary_dim], cos, sin)
        return (torch.cat((turned_q, q[..., self.rotary_dim:]), dim=-1),
                None if k is None else torch.cat((turned_k, k[..., self.rotary_dim:]), dim=-1))

    def _attend_shared(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache | None,
                       starts: Tensor | None, shared_kv: tuple[Tensor, Tensor] | None) -> Tensor:
        """A KV-sharing layer: its queries over its source layer's keys and values (in the
        cache, which it leaves as it is, or handed over)."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q).to(q.dtype)
        q = self._rotate(q.transpose(1, 2), None, cos, sin)[0]
        if kv_cache is not None:
            out = kv_cache.attend(self.kv_source, q, None, None, self.variant)
        elif shared_kv is None:
            raise ValueError(f"layer {self.layer_idx} shares layer {self.kv_source}'s keys and "
                             "values: pass them (shared_kv) or a KV cache")
        else:
            out = causal_attention(q, *shared_kv, self.variant, starts)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu), or GeGLU with GELU's tanh
    approximation (Gemma)."""

    def __init__(self, config: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or config.ffn_hidden_dim
        self.gate_proj = nn.Linear(config.dim, hidden, bias=False)
        self.up_proj = nn.Linear(config.dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, config.dim, bias=False)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(gated(self.gate_proj(x), self.up_proj(x), self.gelu))


def gated(gate: Tensor, up: Tensor, gelu: bool) -> Tensor:
    """act(gate) * up: SwiGLU, or GeGLU with GELU's tanh approximation."""
    return F.gelu(gate, approximate="tanh") * up if gelu else swiglu(gate, up)


def run_each_expert(x: Tensor, experts: Tensor, weights: Tensor,
                    mlp: Callable[[int, Tensor], Tensor]) -> Tensor:
    """The per-expert loop: each expert any of the (T, k) `experts` names runs its tokens
    through `mlp(expert, rows)`; the outputs, times the (T, k) `weights`, are summed per
    token."""
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        token, slot = torch.where(experts == expert)
        y = mlp(expert, x[token])
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out


class Experts(nn.Module):
    """`n` gated MLPs stored stacked (transformers 5's layout): `gate_up_proj` (n, 2·hidden,
    dim), gate rows first, and `down_proj` (n, dim, hidden)."""

    def __init__(self, n: int, dim: int, hidden: int, gelu: bool):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, hidden))
        self.gelu = gelu

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """(T, dim) tokens, each sent to the (T, k) `experts` with (T, k) `weights` -> (T, dim).
        The token-expert pairs are sorted by expert and run as two grouped GEMMs, with no
        loop over experts."""
        k = experts.shape[1]
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        tokens, sorted_experts = order // k, flat[order]
        gate_up = grouped_matmul(x[tokens], self.gate_up_proj.to(x.dtype).transpose(1, 2),
                                 sorted_experts)
        hidden = gated(*gate_up.chunk(2, dim=-1), self.gelu)
        out = grouped_matmul(hidden, self.down_proj.to(x.dtype).transpose(1, 2),
                             sorted_experts)
        out = out * weights.flatten()[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out.to(x.dtype))

    def forward_loop(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """The reference: a loop over the experts any token was sent to (transformers')."""
        def mlp(expert: int, rows: Tensor) -> Tensor:
            gate, up = F.linear(rows, self.gate_up_proj[expert]).chunk(2, dim=-1)
            return F.linear(gated(gate, up, self.gelu), self.down_proj[expert])
        return run_each_expert(x, experts, weights, mlp)


class MoE(nn.Module):
    """A mixture-of-experts MLP: the router (`gate`) scores the experts and each token goes
    to its top `n_experts_per_token`. Softmax router: by probability, weighted by those
    probabilities (renormalized to sum 1 when `norm_topk_prob`). Sigmoid router (DeepSeek-V3's,
    GLM-4.5's): by sigmoid score plus the router's `e_score_correction_bias` (fp32, moved by
    aux-loss-free balancing, not by gradients), among the experts of the best
    `topk_expert_groups` groups (a group scores by the sum of its best two), weighted by the
    unbiased scores (renormalized when `norm_topk_prob`) times `routed_scaling_factor`; the
    router runs in fp32, as transformers keeps it. Dropless: every token reaches its experts.
    While `sink` is a list (the model's forward with labels sets it), each forward appends
    its router logits and chosen experts to it, for the training losses and the balance — an
    attribute, not an argument: FSDP2 rebuilds a sharded layer's argument containers, and an
    activation-checkpointing recompute must not append twice. A shared expert takes every
    token, its output scaled by sigmoid(shared_expert_gate) when the family gates it
    (Qwen2-MoE). Beside the MLP (`experts_beside_mlp`, Gemma 4 26B-A4B): the shared expert is
    the layer's MLP on its normed input, the router and the experts read the layer's
    `residual` (the experts through `experts_input_norm`), each part is normed on its own
    before the sum, and the router scores its weightless RMSNorm times its `scale` and
    dim^-½, each chosen expert's weight times its `per_expert_scale`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = Experts(config.n_experts, config.dim, config.moe_ffn_hidden_dim,
                               config.hidden_act == "gelu_pytorch_tanh")
        self.top_k, self.normalize = config.n_experts_per_token, config.norm_topk_prob
        self.sigmoid = config.sigmoid_router
        if self.sigmoid:
            self.gate.register_buffer("e_score_correction_bias",
                                      torch.zeros(config.n_experts, dtype=torch.float32))
            self.groups, self.topk_groups = config.n_expert_groups, config.topk_expert_groups
            self.scaling = config.routed_scaling_factor
        self.shared = bool(config.shared_expert_dim)
        if self.shared:
            self.shared_expert = MLP(config, config.shared_expert_dim)
        self.shared_gated = self.shared and config.shared_expert_gate
        if self.shared_gated:
            self.shared_expert_gate = nn.Linear(config.dim, 1, bias=False)
        self.beside = config.experts_beside_mlp
        if self.beside:
            self.gate.scale = nn.Parameter(torch.ones(config.dim))
            self.gate.per_expert_scale = nn.Parameter(torch.ones(config.n_experts))
            self.eps = config.norm_eps
            for name in ("shared_expert_norm", "experts_input_norm", "experts_norm"):
                setattr(self, name, RMSNorm(config.dim, config.norm_eps,
                                            config.norm_unit_offset))
        self.sink: list[Routing] | None = None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(T, dim) -> router logits (T, E), the chosen experts (T, k) and their weights."""
        if self.sigmoid:
            return self._route_sigmoid(x)
        if self.beside:
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
            x = normed * self.gate.scale.to(x.dtype) * x.shape[-1] ** -0.5
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.beside:
            weights = weights * self.gate.per_expert_scale[experts]
        return logits, experts, weights

    def _route_sigmoid(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.gate.e_score_correction_bias.float()
        if self.topk_groups < self.groups:
            grouped = choice.view(choice.shape[0], self.groups, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = group_scores.topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, experts, weights * self.scaling

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routed = flat if residual is None else residual.reshape(flat.shape)
        logits, experts, weights = self.route(routed)
        if self.sink is not None:
            self.sink.append((logits, experts))
        if self.beside:
            out = self.experts_norm(self.experts(self.experts_input_norm(routed), experts,
                                                 weights))
            return (out + self.shared_expert_norm(self.shared_expert(flat))).view_as(x)
        out = self.experts(flat, experts, weights)
        if self.shared:
            shared = self.shared_expert(flat)
            if self.shared_gated:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view_as(x)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual; with `sandwich_norms`
    (Gemma) each output is normed again before its add, and the MLP's input norm is
    `pre_feedforward_layernorm` (`post_attention_layernorm` is then the attention output's);
    with `post_norms` (OLMo 2) only the outputs are normed, by `post_attention_layernorm`
    and `post_feedforward_layernorm`."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        def norm() -> RMSNorm:
            return RMSNorm(config.dim, config.norm_eps, config.norm_unit_offset)
        self.post_only = config.post_norms
        if not self.post_only:
            self.input_layernorm = norm()
        self.linear = config.is_linear(layer_idx)  # Qwen3.5: a Gated DeltaNet, no attention
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = norm()
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
        if config.sandwich_norms or config.post_norms:
            self.post_feedforward_layernorm = norm()
        self.sandwich = config.sandwich_norms
        self.mlp = MoE(config) if config.is_moe_layer(layer_idx) else MLP(
            config, config.ffn_width(layer_idx))
        self.experts_beside_mlp = isinstance(self.mlp, MoE) and self.mlp.beside
        self.per_layer_input = bool(config.per_layer_dim)
        if self.per_layer_input:  # Gemma 4 E2B/E4B: a branch gated by the layer's own input
            self.per_layer_input_gate = nn.Linear(config.dim, config.per_layer_dim, bias=False)
            self.per_layer_projection = nn.Linear(config.per_layer_dim, config.dim, bias=False)
            self.post_per_layer_input_norm = norm()
            self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.scaled = config.layer_scalar
        if self.scaled:  # Gemma 4: the layer's output times a stored scalar
            self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: KVCache | None,
                starts: Tensor | None = None, per_layer_input: Tensor | None = None,
                shared_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """`per_layer_input` (B, T, per_layer_dim): this layer's own input (Gemma 4's
        per-layer embeddings); `shared_kv`: a KV-sharing layer's keys and values, without a
        cache."""
        if self.post_only:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, kv_cache, starts))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        attended = self.linear_attn(self.input_layernorm(x), kv_cache, starts) if self.linear \
            else self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, starts, shared_kv)
        if not self.sandwich:
            norm = self.post_attention_layernorm
            normed, x = add_rms_norm(attended, x, norm.scale(), norm.eps)  # one pass: add + norm
            return x + self.mlp(normed)
        norm = self.pre_feedforward_layernorm
        normed, x = add_rms_norm(self.post_attention_layernorm(attended), x, norm.scale(),
                                 norm.eps)
        mlp = self.mlp(normed, x) if self.experts_beside_mlp else self.mlp(normed)
        x = x + self.post_feedforward_layernorm(mlp)
        if self.per_layer_input:
            gate = gated(self.per_layer_input_gate(x), per_layer_input, self.gelu)
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar if self.scaled else x


def _narrowed(kv_cache: KVCache | None, keep: Tensor | None
              ) -> tuple[KVCache, Tensor, Tensor] | None:
    """`kv_cache` for the `keep` rows alone (`KVCache.narrow`), those rows ascending, and
    where each kept row is among them; None where there is nothing to narrow or the cache
    cannot."""
    if kv_cache is None or keep is None:
        return None
    order = keep.argsort()
    narrowed = kv_cache.narrow(keep[order])
    return None if narrowed is None else (narrowed, keep[order], order.argsort())


class Decoder(nn.Module):
    """Everything but the LM head (HF's `LlamaModel`, hence the `model.` name prefix)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # On the meta device (a checkpoint's load) nn.Embedding's own init would run a meta
        # `normal_`, whose kernel imports torch._dynamo (~1.5 s); elsewhere its draw stays,
        # so a seed initializes a new model as it always has
        meta = torch.empty(0).is_meta
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim, _weight=torch.empty(
            config.vocab_size, config.dim) if meta else None)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_unit_offset)
        if config.per_layer_dim:  # Gemma 4 E2B/E4B: every layer's input, side by side
            width = config.n_layers * config.per_layer_dim
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size, width, _weight=(
                torch.empty(config.vocab_size, width) if meta else None))
            self.per_layer_model_projection = nn.Linear(config.dim, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(config.per_layer_dim, config.norm_eps,
                                                     config.norm_unit_offset)
        # Gemma 4's full layers: heads of their own width, turned by a table as wide
        full_width = config.global_shape[1]
        self.rotary_emb = RotaryEmbedding(config if full_width == config.head_dim else
                                          dataclasses.replace(config, head_dim=full_width))
        # Gemma 3 and 4: the sliding layers' RoPE, its own base, no scaling, turning whole heads
        self.rotary_emb_local = None if config.rope_local_theta is None else RotaryEmbedding(
            dataclasses.replace(config, rope_theta=config.rope_local_theta, rope_scaling=None,
                                rope_proportion=None))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        configure_kernels()  # which kernels its ops take, chosen once, here
        self.config = config
        self.model = Decoder(config)
        if config.num_labels:  # a sequence classifier: HF's score head, no LM head
            self.score = nn.Linear(config.dim, config.num_labels, bias=False)
        else:
            self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        # Compute the head chunk by chunk with the loss (or a head op) when no logits are
        # asked for. The chunked paths read the whole weight (FSDP2 unshards the root's
        # weights for its forward; DeepSpeed's ZeRO-3 engine gathers a partitioned weight
        # its forward reads outside the weight's module); whoever wraps the head in what
        # `head_weight` cannot express (LoRA with dropout, QLoRA) turns this off.
        self.chunked_head = True
        self.tie_weights()
        if self.model.embed_tokens.weight.device.type != "meta":
            self.init_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config asks for it."""
        if self.config.tie_embeddings and not self.config.num_labels:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize as described in the module docstring (also after meta-device init)."""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                out_proj = name.endswith(("o_proj", "down_proj", "linear_attn.out_proj"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if out_proj else std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                (nn.init.zeros_ if module.unit_offset else nn.init.ones_)(module.weight)
            elif isinstance(module, GatedRMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, GatedDeltaNet):  # transformers' Qwen3.5 initialization
                nn.init.normal_(module.conv1d.weight, mean=0.0, std=std)
                nn.init.ones_(module.dt_bias)
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16).log())
            elif isinstance(module, Experts):
                nn.init.normal_(module.gate_up_proj, mean=0.0, std=std)
                nn.init.normal_(module.down_proj, mean=0.0, std=residual_std)
            elif isinstance(module, MoE) and module.sigmoid:
                nn.init.zeros_(module.gate.e_score_correction_bias)
            elif isinstance(module, MoE) and module.beside:
                nn.init.ones_(module.gate.scale)
                nn.init.ones_(module.gate.per_expert_scale)
            elif isinstance(module, DecoderLayer) and module.scaled:
                nn.init.ones_(module.layer_scalar)
        self.reset_rotary()

    def reset_rotary(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE frequency buffers (not in the state dict), e.g. after loading
        weights into a model built on the meta device."""
        self.model.rotary_emb.reset_parameters(device)
        if self.model.rotary_emb_local is not None:
            self.model.rotary_emb_local.reset_parameters(device)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None,
                positions: Tensor | None = None, kv_cache: KVCache | None = None,
                logits_to_keep: Tensor | None = None,
                return_logits: bool = True, documents: Tensor | None = None,
                head: bool = True, z_loss: float = 0.0,
                head_op: HeadOp | None = None,
                token_mask: Tensor | None = None) -> CausalLMOutput:
        """Logits (B, T, vocab) for `input_ids` (B, T), and the loss when `labels` are given.

        `labels` align with `input_ids` (HF convention): position t's logits are scored
        against labels[t + 1], and label -100 is ignored. `positions` (B, T) defaults to
        0..T-1, or to what the cache assigns when `kv_cache` is given. `logits_to_keep`
        (indices along T) computes the LM head only there — serving needs one row per
        sequence, not one per prompt token; with a `kv_cache`, the layers that share an
        earlier layer's keys and values (Gemma 4 E2B's, E4B's) run on those rows alone, as
        they store nothing the next tokens read (`KVCache.narrow`). With labels and
        `return_logits=False` the loss goes through `lathe.kernels.linear_cross_entropy`,
        which never holds the full (B·T × vocab) logits; `logits` is then None. `z_loss`
        adds PaLM's z-loss to the loss (z_loss · mean logsumexp², the mean itself in `z`
        when computed). With a `head_op` the LM head's output goes to it (chunked likewise)
        and its result is `head`; with labels too, that result is the loss (a mixture of
        experts' router losses added). With `head=False` the LM head is left out: `hidden`
        holds the final norm's output, whose rows the caller passes to `compute_logits` — a
        compiled serving step computes the head only on the rows it samples, as vLLM's does.

        `documents` (B, T): packed rows, several documents per row, each a contiguous run
        of one id. Attention stays inside each document and positions restart at each
        (unless given), so a packed row computes what its documents would alone (for the
        loss too when each document's first label is -100: else the previous document's
        last token predicts it).

        A mixture of experts returns its routing (`router`: its losses and loads) with
        labels, and whenever autograd records (a stage's own loss on the head's output adds
        `router.loss`, with `with_router_losses`); `token_mask` (B, T), True at a padded
        batch's real tokens, leaves the pads out of it, as transformers' attention_mask does.
        """
        if labels is not None and not head:
            raise ValueError("head=False returns the final hidden states and no loss; pass "
                             "labels only with the LM head (head=True)")
        starts = None
        if documents is not None:
            if kv_cache is not None:
                raise ValueError("documents (packed rows) are for training: a KV cache "
                                 "holds one sequence per row")
            starts = document_starts(documents)
            if positions is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device) - starts
        if kv_cache is not None:
            positions = kv_cache.prepare(input_ids, positions)
        elif positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            positions = positions.expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale:  # Gemma: √dim, rounded to the embeddings' dtype first
            x = x * torch.tensor(self.config.dim ** 0.5, dtype=x.dtype)
        rotations = self.model.rotary_emb(positions, x.dtype)
        local = self.model.rotary_emb_local
        local_rotations = rotations if local is None else local(positions, x.dtype)
        per_layer = self._per_layer_inputs(input_ids, x) if self.config.per_layer_dim else None
        routing: list[Routing] = []  # the MoE layers' routing, for the loss (with labels)
        routed = labels is not None or torch.is_grad_enabled()
        experts = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)] \
            if routed and self.config.n_experts else []
        # without a cache, the layers others share keys and values with hand them over here
        shared: dict[int, tuple[Tensor, Tensor]] = {}
        config = self.config
        sources = [self.model.layers[i].self_attn for i in {
            config.kv_source(layer)
            for layer in range(config.n_layers - config.kv_shared_layers, config.n_layers)}
        ] if kv_cache is None else []
        for moe in experts:
            moe.sink = routing
        for attention in sources:
            attention.kv_sink = shared
        first_shared = config.n_layers - config.kv_shared_layers
        try:
            for i, layer in enumerate(self.model.layers):
                attention = None if layer.linear else layer.self_attn
                kept = _narrowed(kv_cache, logits_to_keep) if i == first_shared else None
                if kept is not None:  # the layers left store nothing: the kept rows alone
                    kv_cache, rows, logits_to_keep = kept
                    x = x[:, rows]
                    rotations, local_rotations = ((cos[:, rows], sin[:, rows])
                                                  for cos, sin in (rotations, local_rotations))
                    per_layer = None if per_layer is None else per_layer[:, rows]
                local_rope = attention is not None and attention.local_rope
                sharing = attention is not None and attention.shares_kv
                x = layer(x, *(local_rotations if local_rope else rotations),
                          kv_cache, starts, None if per_layer is None else per_layer[:, :, i],
                          shared.get(attention.kv_source) if sharing else None)
        finally:
            for moe in experts:
                moe.sink = None
            for attention in sources:
                attention.kv_sink = None
        router = router_stats(routing, self.config, token_mask) if routing else None
        if logits_to_keep is not None:
            x = x[:, logits_to_keep]
        x = self.model.norm(x)
        if not head:
            return CausalLMOutput(None, None, router, x)
        if self.config.num_labels:
            if labels is not None or head_op is not None:
                raise ValueError("a sequence classifier (num_labels > 0) returns its scores "
                                 "at every position; its loss is the caller's")
            return CausalLMOutput(self.score(x), None, router)
        cap = self.config.final_softcap
        if head_op is not None:
            result = (head_op.chunked(x, self.head_weight(), cap) if self.chunked_head
                      else head_op.from_logits(self.compute_logits(x)))
            loss = None if labels is None else with_router_losses(result, router)
            return CausalLMOutput(None, loss, router, head=result)
        if labels is not None and not return_logits and self.chunked_head:
            loss, z = linear_cross_entropy(x[:, :-1].flatten(0, 1), self.head_weight(),
                                           labels[:, 1:].flatten(), IGNORE_INDEX,
                                           softcap=cap, z_loss=z_loss)
            return CausalLMOutput(None, with_router_losses(loss, router), router, z=z)
        logits = self.compute_logits(x)
        if labels is None:
            return CausalLMOutput(logits, None, router)
        scored = logits[:, :-1].flatten(0, 1).float()
        targets = labels[:, 1:].flatten()
        loss, z = F.cross_entropy(scored, targets, ignore_index=IGNORE_INDEX), None
        if z_loss:
            valid = targets != IGNORE_INDEX
            z = (torch.logsumexp(scored, -1).square() * valid).sum() / valid.sum().clamp(min=1)
            loss = loss + z_loss * z
        return CausalLMOutput(logits, with_router_losses(loss, router), router, z=z)

    def _per_layer_inputs(self, input_ids: Tensor, embedded: Tensor) -> Tensor:
        """Gemma 4's per-layer inputs (B, T, n_layers, per_layer_dim): the tokens' rows of
        the per-layer table (times √per_layer_dim) and the normed projection of their
        (scaled) embeddings, averaged by 1/√2 — transformers' arithmetic."""
        decoder, width = self.model, self.config.per_layer_dim
        shape = (*input_ids.shape, self.config.n_layers, width)
        rows = decoder.embed_tokens_per_layer(input_ids)
        rows = (rows * torch.tensor(width ** 0.5, dtype=rows.dtype)).view(shape)
        projected = decoder.per_layer_model_projection(embedded) * self.config.dim ** -0.5
        projected = decoder.per_layer_projection_norm(projected.view(shape))
        return (projected + rows) * 2 ** -0.5

    def head_weight(self) -> Tensor:
        """The LM head's weight as the chunked paths read it: with LoRA adapters on the
        head (peft's layer, unmerged and enabled), the base weight plus each active
        adapter's scaled B·A — a (vocab, dim) tensor, where the logits are (tokens, vocab)."""
        head = self.lm_head
        if not hasattr(head, "base_layer"):
            return head.weight
        weight = head.base_layer.weight
        if head.merged or head.disable_adapters:
            return weight
        for name in head.active_adapters:
            if name in head.lora_A:
                weight = weight + head.get_delta_weight(name)
        return weight

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """The LM head over final-norm outputs (`hidden`, (..., dim)), soft-capped where the
        family caps them (Gemma 2: logits -> cap * tanh(logits / cap))."""
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

