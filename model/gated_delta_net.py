"""Qwen3.5's linear-attention layer: a Gated DeltaNet token mixer in place of attention.

From the layer's normed input: q, k and v from one projection (`in_proj_qkv`) through a
short causal convolution and SiLU; a per-value-head learning rate β = sigmoid(in_proj_b x)
and log decay g = −exp(A_log) · softplus(in_proj_a x + dt_bias); the gated delta rule
(`lathe.kernels.gated_delta`) over them; each value head's output RMS-normed and gated by
SiLU(in_proj_z x); `out_proj` back to the model's width. Names and arithmetic are
transformers' `Qwen3_5GatedDeltaNet`, so its checkpoints load as they are.

With a cache, the layer hands it its per-token inputs and `mix` (`KVCache.recurrent`), which
the cache runs over each sequence from the states it holds for it — the convolution's last
inputs and the rule's (value heads, key width, value width) state — keeping the new ones;
without, each packed document starts from zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lathe.kernels.gated_delta import gated_delta_recurrence, gated_delta_rule, short_convolution
from lathe.model.config import ModelConfig
from lathe.model.kv_cache import KVCache, States


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, times SiLU of its gate (the norm's weight is plain,
    starting at ones)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.key_heads, self.value_heads = config.linear_key_heads, config.linear_value_heads
        self.key_dim = config.linear_key_heads * config.linear_key_head_dim
        self.value_dim = config.linear_value_heads * config.linear_value_head_dim
        self.head_dims = config.linear_key_head_dim, config.linear_value_head_dim
        channels = config.linear_conv_channels
        self.in_proj_qkv = nn.Linear(config.dim, channels, bias=False)
        self.in_proj_z = nn.Linear(config.dim, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(config.dim, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(config.dim, self.value_heads, bias=False)
        # transformers' module and weight shape (channels, 1, kernel); run by short_convolution
        self.conv1d = nn.Conv1d(channels, channels, config.linear_conv_kernel, bias=False,
                                groups=channels, padding=config.linear_conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(config.linear_value_head_dim, config.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, config.dim, bias=False)

    def forward(self, x: Tensor, kv_cache: KVCache | None = None,
                starts: Tensor | None = None) -> Tensor:
        """x (B, T, dim) -> (B, T, dim); `starts`: packed rows' document starts."""
        batch, length, _ = x.shape
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        inputs = (self.in_proj_qkv(x), beta, g)
        if kv_cache is None:
            out = self.mix(inputs, None, starts)[0]
        else:
            out = kv_cache.recurrent(self.layer_idx, inputs, self.mix)
        z = self.in_proj_z(x).view(batch, length, self.value_heads, self.head_dims[1])
        return self.out_proj(self.norm(out, z).reshape(batch, length, self.value_dim))

    def mix(self, inputs: tuple[Tensor, ...], states: States | None,
            starts: Tensor | None = None, every: bool = False) -> tuple[Tensor, States]:
        """The convolution and the rule over (B, T, ·) inputs — q/k/v before the
        convolution, β, g — from `states` (the convolution's last inputs, the rule's state;
        None: zeros): the (B, T, value heads, value width) output and the states after —
        with `every`, after each token (a T dimension after B), token by token."""
        mixed, beta, g = inputs
        batch, length, _ = mixed.shape
        conv_state, state = (None, None) if states is None else states
        mixed, conv_state = short_convolution(mixed, self.conv1d.weight[:, 0], starts,
                                              conv_state, every)
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        key_width, value_width = self.head_dims
        q = q.view(batch, length, self.key_heads, key_width)
        k = k.view(batch, length, self.key_heads, key_width)
        v = v.view(batch, length, self.value_heads, value_width)
        if every:
            out, state = gated_delta_recurrence(q, k, v, g, beta, starts, state, every=True)
        else:
            rule = gated_delta_recurrence if length == 1 else gated_delta_rule
            out, state = rule(q, k, v, g, beta, starts, state)
        return out, (conv_state, state)
