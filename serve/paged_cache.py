"""The paged KV cache's storage, and the per-step view the shared model attends through.

`KVSlabs` holds one K and one V slab per layer, shaped (num_blocks * block_size,
n_kv_heads, head_dim): block b's token slot i lives at row b * block_size + i. Which
blocks a sequence owns is the `BlockManager`'s business; this module only reads and
writes rows.

`PagedBatch` is one engine step: the new tokens of every scheduled sequence flattened
into a single row (prefill chunks and single decode tokens side by side). It implements
`lathe.model.kv_cache.KVCache`, so the unmodified `Transformer` runs on it: `attend`
writes the step's K/V into the slabs, then attends each sequence's queries over its own
context only — decode rows together in one padded SDPA call, each prefill chunk in its
own causal SDPA call — so a mixed step computes exactly what separate steps would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lathe.kernels.attention import causal_attention
from lathe.kernels.dispatch import use_triton
from lathe.kernels.paged_attention import paged_decode_triton
from lathe.model.config import ModelConfig


class KVSlabs:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        shape = (config.n_layers, num_blocks * block_size, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.n_layers * block_size * config.n_kv_heads * config.head_dim * itemsize

    def slots(self, blocks: Sequence[int], start: int, end: int) -> list[int]:
        """Slab rows of token positions [start, end) of a sequence owning `blocks`."""
        size = self.block_size
        return [blocks[p // size] * size + p % size for p in range(start, end)]


@dataclass
class SequenceSpan:
    """One sequence's share of a step: its queries are row[start:start + length] and they
    attend over `context` (slab rows of every token up to and including the last query)."""

    start: int
    length: int
    context: Tensor


class PagedBatch:
    def __init__(self, slabs: KVSlabs, spans: list[SequenceSpan], positions: Tensor,
                 slot_mapping: Tensor) -> None:
        self.slabs = slabs
        self.positions = positions
        self.slot_mapping = slot_mapping
        self.prefills = [s for s in spans if s.length > 1]
        decodes = [s for s in spans if s.length == 1]
        device = positions.device
        self.decode_rows = torch.tensor([s.start for s in decodes], device=device,
                                        dtype=torch.long)
        if decodes:
            width = max(len(s.context) for s in decodes)
            self.decode_context = torch.zeros(len(decodes), width, dtype=torch.long,
                                              device=device)
            self.decode_mask = torch.zeros(len(decodes), 1, 1, width, dtype=torch.bool,
                                           device=device)
            for i, span in enumerate(decodes):
                self.decode_context[i, :len(span.context)] = span.context
                self.decode_mask[i, ..., :len(span.context)] = True
            size = slabs.block_size  # each block's slots are contiguous: its first names it
            self.decode_tables = self.decode_context[:, ::size] // size
            self.decode_lens = self.decode_mask.flatten(1).sum(-1)

    def prepare(self, input_ids: Tensor, positions: Tensor | None) -> Tensor:
        if input_ids.shape != (1, len(self.slot_mapping)):
            raise ValueError(f"a paged batch takes its {len(self.slot_mapping)} tokens as one "
                             f"row, got input_ids of shape {tuple(input_ids.shape)}")
        return self.positions[None]

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k_slab, v_slab = self.slabs.k[layer_idx], self.slabs.v[layer_idx]
        k_slab[self.slot_mapping] = k[0].transpose(0, 1)
        v_slab[self.slot_mapping] = v[0].transpose(0, 1)
        out = torch.empty_like(q)
        if len(self.decode_rows):
            queries = q[0, :, self.decode_rows].transpose(0, 1)  # (B, H, D)
            if use_triton("paged_decode", q):
                attended = paged_decode_triton(queries, k_slab, v_slab, self.decode_tables,
                                               self.decode_lens, self.slabs.block_size)
            else:
                keys = k_slab[self.decode_context].transpose(1, 2)  # (B, kv_heads, S, D)
                values = v_slab[self.decode_context].transpose(1, 2)
                attended = F.scaled_dot_product_attention(
                    queries[:, :, None], keys, values, attn_mask=self.decode_mask,
                    enable_gqa=q.shape[1] != k.shape[1])[:, :, 0]
            out[0, :, self.decode_rows] = attended.transpose(0, 1)
        for span in self.prefills:
            rows = slice(span.start, span.start + span.length)
            keys = k_slab[span.context].transpose(0, 1)[None]
            values = v_slab[span.context].transpose(0, 1)[None]
            out[:, :, rows] = causal_attention(q[:, :, rows], keys, values)
        return out
