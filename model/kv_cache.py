"""The KV-cache interface the attention layers talk to, and a simple contiguous cache.

The model never knows how keys and values are stored. Once per forward it asks the
cache to `prepare` room for the new tokens (getting back their positions and the
attention mask), then each layer hands the cache its new K/V through `update` and gets
back everything the new queries may attend to. `ContiguousKVCache` stores one dense
buffer per layer (generation in `lathe.model.generate`, tests); the serving engine's
paged cache implements the same two methods over its block tables.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from lathe.model.config import ModelConfig


class KVCache(Protocol):
    def prepare(self, input_ids: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Reserve room for the (B, T) new tokens of this forward.

        Returns their (B, T) positions (for RoPE) and the attention mask for this step:
        a bool tensor broadcastable to (B, 1, T, S) where True means "may attend" and S
        is the length `update` returns, or None for plain causal attention among the
        new tokens when nothing is cached before them.
        """
        ...

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this layer's new (B, n_kv_heads, T, head_dim) keys and values; return the
        (B, n_kv_heads, S, head_dim) keys and values the new queries attend over."""
        ...


class ContiguousKVCache:
    """One preallocated (B, n_kv_heads, max_len, head_dim) buffer per layer and for K and V.

    All rows of the batch share one length: slot i holds the token at position i.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        shape = (config.n_layers, batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0
        self._start = 0

    def prepare(self, input_ids: Tensor, positions: Tensor | None) -> tuple[Tensor, Tensor | None]:
        batch, new = input_ids.shape
        if batch != self.k.shape[1]:
            raise ValueError(f"batch of {batch} rows does not match the cache's {self.k.shape[1]}")
        start, end = self.length, self.length + new
        if end > self.max_len:
            raise ValueError(
                f"KV cache full: {start} cached + {new} new tokens > max_len={self.max_len}; "
                "allocate the cache with max_len >= prompt length + new tokens"
            )
        self._start, self.length = start, end
        if positions is None:
            positions = torch.arange(start, end, device=input_ids.device).expand(batch, new)
        if start == 0:
            return positions, None
        query_slots = torch.arange(start, end, device=input_ids.device)[:, None]
        key_slots = torch.arange(end, device=input_ids.device)[None, :]
        return positions, (key_slots <= query_slots)[None, None]

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        start, end = self._start, self.length
        self.k[layer_idx, :, :, start:end] = k
        self.v[layer_idx, :, :, start:end] = v
        return self.k[layer_idx, :, :, :end], self.v[layer_idx, :, :, :end]
