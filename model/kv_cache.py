"""The KV-cache interface the attention layers talk to, and a simple contiguous cache.

The model never knows how keys and values are stored. Once per forward it asks the
cache to `prepare` room for the new tokens (getting back their positions), then each
attention layer hands the cache its queries and new K/V through `attend` and gets back
the attention output: the cache stores the new K/V and attends over everything each
query may see. Past the last layer that stores keys and values (Gemma 4's KV-sharing
layers) the model may `narrow` the cache to the rows whose logits it keeps. A linear-attention
layer (Qwen3.5's Gated DeltaNet) keeps no keys or values but a recurrent state per sequence:
it hands the cache its per-token inputs and the function that runs it over one batch of
sequences from their states (`recurrent`), and the cache runs it over each sequence's tokens
from the state it holds for that sequence, keeping the state it ends in.
`ContiguousKVCache` stores one dense buffer per layer (generation in
`lathe.model.generate`, tests); the serving engine's paged cache implements the same
methods over block tables, for a batch of sequences of different lengths flattened into
one row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeAlias

import torch
from torch import Tensor

from lathe.kernels import PLAIN, AttentionVariant, causal_attention
from lathe.model.config import ModelConfig

States: TypeAlias = tuple[Tensor, ...]


class RecurrentStep(Protocol):
    """A linear-attention layer's computation: (B, T, ·) inputs of B sequences and their
    states before them (None: fresh sequences) -> the (B, T, ·) output and the states after
    them — with `every`, after each token (a T dimension after B)."""

    def __call__(self, inputs: tuple[Tensor, ...], states: States | None, /, *,
                 every: bool = False) -> tuple[Tensor, States]: ...


class KVCache(Protocol):
    def prepare(self, input_ids: Tensor, positions: Tensor | None) -> Tensor:
        """Reserve room for the (B, T) new tokens of this forward; return their (B, T)
        positions (for RoPE)."""
        ...

    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None,
               variant: AttentionVariant = PLAIN) -> Tensor:
        """Store this layer's new (B, n_kv_heads, T, head_dim) keys and values and return
        the causal attention of the (B, n_heads, T, head_dim) queries over every cached
        and new key of their own sequence they may see (the layer's `variant`: a sliding
        window, ...), shaped like `q`. `k` and `v` None: attend over what layer
        `layer_idx` stored in this forward, storing nothing (a layer sharing its keys and
        values, as Gemma 4's last layers do)."""
        ...

    def narrow(self, rows: Tensor) -> KVCache | None:
        """This forward's cache for the queries of the new tokens at ascending `rows`
        (indices along T) alone — the layers after the last that stores keys and values
        need no other rows, only those whose logits are kept — or None where that is every
        row or it cannot attend them so."""
        ...

    def recurrent(self, layer_idx: int, inputs: tuple[Tensor, ...],
                  step: RecurrentStep) -> Tensor:
        """A linear-attention layer's output for this forward's tokens: `step` run over
        each sequence's share of the (1 or B, T, ·) `inputs`, from the states the cache
        holds for the sequence (none at its first token), which it then replaces with the
        states `step` ends in."""
        ...


class ContiguousKVCache:
    """One preallocated (B, n_kv_heads, max_len, head_dim) buffer per layer and for K and V
    (each layer's own KV heads and head width: Gemma 4's full layers have theirs; a layer
    sharing another's keys and values has that layer's buffers).

    All rows of the batch share one length: slot i holds the token at position i. A
    linear-attention layer has no buffers, only its recurrent state.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        def buffer(layer: int) -> Tensor:
            kv_heads, width = config.attention_shape(layer)
            length = 0 if config.is_linear(layer) else max_len
            return torch.zeros(batch_size, kv_heads, length, width, device=device, dtype=dtype)

        self.k, self.v = per_layer_buffers(config, buffer)
        self.states: dict[int, States] = {}
        self.batch_size, self.dtype = batch_size, dtype
        self.max_len = max_len
        self.length = 0
        self._start = 0

    def prepare(self, input_ids: Tensor, positions: Tensor | None) -> Tensor:
        batch, new = input_ids.shape
        if batch != self.batch_size:
            raise ValueError(f"batch of {batch} rows does not match the cache's "
                             f"{self.batch_size}")
        start, end = self.length, self.length + new
        if end > self.max_len:
            raise ValueError(
                f"KV cache full: {start} cached + {new} new tokens > max_len={self.max_len}; "
                "allocate the cache with max_len >= prompt length + new tokens"
            )
        self._start, self.length = start, end
        if positions is None:
            positions = torch.arange(start, end, device=input_ids.device).expand(batch, new)
        return positions

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor,
               variant: AttentionVariant = PLAIN) -> Tensor:
        """Attention runs in the cache's dtype (K/V are stored in it, q is converted), so a
        cache of one dtype serves activations of another, e.g. under bf16 autocast."""
        start, end = self._start, self.length
        keys, values = self.k[layer_idx], self.v[layer_idx]
        if k is not None:
            keys[:, :, start:end] = k
            values[:, :, start:end] = v
        out = causal_attention(q.to(self.dtype), keys[:, :, :end], values[:, :, :end], variant)
        return out.to(q.dtype)

    def recurrent(self, layer_idx: int, inputs: tuple[Tensor, ...],
                  step: RecurrentStep) -> Tensor:
        out, self.states[layer_idx] = step(inputs, self.states.get(layer_idx))
        return out

    def narrow(self, rows: Tensor) -> ContiguousKVCache | None:
        """Itself for some last rows of the new tokens, whose queries attend as they would
        among all (`attend` aligns queries to the end); None for all rows or any others."""
        new = self.length - self._start
        if len(rows) >= new:
            return None
        return self if rows.tolist() == list(range(new - len(rows), new)) else None


def per_layer_buffers(config: ModelConfig, make: Callable[[int], Tensor]
                      ) -> tuple[list[Tensor], list[Tensor]]:
    """Each layer's K and V buffers, `make(layer)` each: a layer that shares another's keys
    and values (`ModelConfig.kv_source`) is given that layer's buffers, not its own."""
    keys: list[Tensor] = []
    values: list[Tensor] = []
    for layer in range(config.n_layers):
        source = config.kv_source(layer)
        keys.append(make(layer) if source == layer else keys[source])
        values.append(make(layer) if source == layer else values[source])
    return keys, values
