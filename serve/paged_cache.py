"""The paged KV cache's storage, and the per-step view the shared model attends through.

`KVSlabs` holds one K and one V slab per layer, each its own tensor (a compiled step that
writes a slice of one stacked tensor would copy all of it), shaped ((num_blocks + 1) *
block_size, n_kv_heads, head_dim) in the layer's own KV heads and width (Gemma 4's full
layers have theirs): block b's token slot i lives at row b * block_size + i, and the extra
block, which the `BlockManager` never hands out, is scratch for the padding rows of
a compiled decode step (`lathe.serve.decode_graph`). Which blocks a sequence owns is the
`BlockManager`'s business; this module only reads and writes rows.

`PagedBatch` is one engine step: the new tokens of every scheduled sequence flattened
into a single row (first the tokens that attend through their block table, then prefill
chunks), as the engine's `ModelRunner` builds it. It implements
`lathe.model.kv_cache.KVCache`, so the unmodified `Transformer` runs on it: `attend`
writes the step's K/V into the slabs, then attends each sequence's queries over its own
context only — the paged rows together through `lathe.kernels.paged_decode` (the Triton
paged kernel on CUDA, the native one on CPU, one padded gather + SDPA elsewhere), each
token over its own context up to its position, so decodes and, on CPU, the tokens of
short prefill chunks; each other prefill chunk through `lathe.kernels.causal_attention`
over its gathered context — so a mixed step computes exactly what separate steps would.
`narrow` gives the step for the rows whose logits are sampled: the layers that share an
earlier layer's keys and values (Gemma 4 E2B's last 20 of 35) need run no others. A model's
linear-attention layers (Qwen3.5's) keep no slabs: `recurrent` runs them over each
sequence's tokens from its state (`lathe.serve.recurrent_states`).

`blocks_in_budget` sizes the slabs: how many blocks an engine's KV budget holds.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lathe.kernels import PLAIN, AttentionVariant, causal_attention, paged_decode
from lathe.model.config import ModelConfig
from lathe.model.kv_cache import RecurrentStep, per_layer_buffers
from lathe.serve.config import DEFAULT_KV_MB, EngineConfig
from lathe.serve.recurrent_states import RecurrentStates, StateSpans
from lathe.serve.request_checks import RequestError


class KVSlabs:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        rows = (num_blocks + 1) * block_size
        self.k, self.v = per_layer_buffers(config, lambda layer: torch.zeros(
            0 if config.is_linear(layer) else rows, *config.attention_shape(layer),
            device=device, dtype=dtype))
        self.block_size, self.dtype = block_size, dtype
        self.scratch_slot = num_blocks * block_size  # first row of the extra block

    @property
    def nbytes(self) -> int:
        """The bytes the slabs hold (a slab layers share, once)."""
        slabs = {id(t): t for t in (*self.k, *self.v)}.values()
        return sum(t.numel() * t.element_size() for t in slabs)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * block_size * config.kv_channels() * itemsize

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
    """One step: each of the first `num_paged` tokens of the row attends through its
    sequence's block table row (`paged_tables`) over its first `paged_lens` slots — the
    decodes, and on CPU the tokens of short prefills too — then prefill chunks (`prefills`)
    attend as a whole."""

    def __init__(self, slabs: KVSlabs, positions: Tensor, slot_mapping: Tensor,
                 num_paged: int, paged_tables: Tensor | None, paged_lens: Tensor | None,
                 prefills: list[SequenceSpan], states: StateSpans | None = None) -> None:
        self.slabs, self.states = slabs, states
        self.positions = positions
        self.slot_mapping = slot_mapping
        self.num_paged = num_paged
        self.paged_tables, self.paged_lens = paged_tables, paged_lens
        self.prefills = prefills
        # told the rows a narrowed step keeps, so per-row state outside the cache follows
        # them (the LoRA slot of each row: `AdapterSlots.rows`)
        self.follow: Callable[[list[int]], None] | None = None

    def prepare(self, input_ids: Tensor, positions: Tensor | None) -> Tensor:
        if input_ids.shape != (1, len(self.slot_mapping)):
            raise ValueError(f"a paged batch takes its {len(self.slot_mapping)} tokens as one "
                             f"row, got input_ids of shape {tuple(input_ids.shape)}")
        return self.positions[None]

    def narrow(self, rows: Tensor) -> PagedBatch | None:
        """The step for the queries at ascending `rows` alone: paged tokens, then of each
        prefill chunk a run of its last tokens (its sampled one; a verification's drafts;
        all of it for prompt log-probs), which attend over the chunk's context as its
        last queries. None for every row (a decode step: nothing to narrow, no host sync)
        and for other rows of a chunk, which the full step serves."""
        if len(rows) >= len(self.slot_mapping) or self.states is not None:
            return None
        kept = rows.tolist()
        paged = [r for r in kept if r < self.num_paged]
        spans, at = [], len(paged)
        if kept[:at] != paged:
            return None
        for span in self.prefills:
            end = span.start + span.length
            length = sum(span.start <= r < end for r in kept)
            if kept[at:at + length] != list(range(end - length, end)):
                return None
            if length:
                spans.append(SequenceSpan(at, length, span.context))
            at += length
        if at != len(kept):
            return None
        if self.follow is not None:
            self.follow(kept)
        index = rows[:len(paged)]
        return PagedBatch(self.slabs, self.positions[rows], self.slot_mapping[rows], len(paged),
                          None if not paged else self.paged_tables[index],
                          None if not paged else self.paged_lens[index], spans)

    def recurrent(self, layer_idx: int, inputs: tuple[Tensor, ...],
                  step: RecurrentStep) -> Tensor:
        if self.states is None:
            raise ValueError("this step was laid out without recurrent states: the engine's "
                             "runner makes them for a model with linear-attention layers")
        return self.states.run(layer_idx, inputs, step)

    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None,
               variant: AttentionVariant = PLAIN) -> Tensor:
        """Attention runs in the slabs' dtype (new K/V are stored in it, q is converted), so
        the cache serves activations of another dtype, e.g. under bf16 autocast."""
        k_slab, v_slab = self.slabs.k[layer_idx], self.slabs.v[layer_idx]
        if k is not None:  # None: a layer sharing layer_idx's, which stored them
            k_slab[self.slot_mapping] = k[0].transpose(0, 1).to(k_slab.dtype)
            v_slab[self.slot_mapping] = v[0].transpose(0, 1).to(v_slab.dtype)
        result_dtype, q = q.dtype, q.to(k_slab.dtype)
        out = torch.empty_like(q)
        if self.num_paged:
            rows = slice(0, self.num_paged)
            queries = q[0, :, rows].transpose(0, 1)  # (B, H, D)
            attended = paged_decode(queries, k_slab, v_slab, self.paged_tables,
                                    self.paged_lens, self.slabs.block_size, variant)
            out[0, :, rows] = attended.transpose(0, 1)
        for span in self.prefills:
            rows = slice(span.start, span.start + span.length)
            keys = k_slab.index_select(0, span.context).transpose(0, 1)[None]
            values = v_slab.index_select(0, span.context).transpose(0, 1)[None]
            out[:, :, rows] = causal_attention(q[:, :, rows], keys, values, variant)
        return out.to(result_dtype)


def engine_cache_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """What an engine of `config.num_blocks` blocks holds beyond the weights, at most (for
    memory plans): its KV slabs and their scratch block, and for a model with
    linear-attention layers the states of `state_rows`."""
    assert config.num_blocks is not None, "a plan sizes an engine of a set block count"
    return ((config.num_blocks + 1) * KVSlabs.bytes_per_block(model, config.block_size, dtype)
            + state_rows(config) * RecurrentStates.bytes_per_sequence(model, dtype))


def state_rows(config: EngineConfig) -> int:
    """How many sequences' linear-attention states an engine holds at most: a running
    sequence's each, the compiled steps' padding row, and each snapshot its prefix cache
    may keep."""
    return config.max_num_seqs + 1 + (config.recurrent_snapshots if config.prefix_caching
                                      else 0)


def blocks_in_budget(config: EngineConfig, models: list[ModelConfig], device: torch.device,
                     dtype: torch.dtype, max_model_len: int) -> int:
    """KV blocks an engine's budget holds (each of `models` — a target and its draft — takes
    its share of every block): `kv_cache_memory_mb` when set, on any device; else on CUDA
    what `gpu_memory_utilization` leaves of the card, and off it what `max_num_seqs`
    sequences of `max_model_len` tokens take, at most DEFAULT_KV_MB."""
    per_block = sum(KVSlabs.bytes_per_block(m, config.block_size, dtype) for m in models)
    on_gpu_share = device.type == "cuda" and config.kv_cache_memory_mb is None
    if config.kv_cache_memory_mb is not None:  # a set budget wins, on a GPU too
        budget = config.kv_cache_memory_mb * 2**20
    elif device.type == "cuda":
        gc.collect()  # an engine dropped but held in a reference cycle frees its cache now
        free, total = torch.cuda.mem_get_info(device)
        # what torch's caching allocator holds unused (an earlier engine's freed cache, say)
        # is free to this process too, though the driver counts it as taken
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        # linear-attention layers' states, a sequence's each and the prefix cache's
        # snapshots', come out of the same memory
        states = state_rows(config) * sum(RecurrentStates.bytes_per_sequence(m, dtype)
                                          for m in models)
        budget = free - (1 - config.gpu_memory_utilization) * total - states
    else:
        per_sequence = -(-max_model_len // config.block_size)
        budget = min(DEFAULT_KV_MB * 2**20, (config.max_num_seqs * per_sequence + 1) * per_block)
    blocks = int(budget // per_block) - 1  # the slabs add a scratch block
    if blocks < 1:
        where = (f"{free / 2**30:.1f} GiB of the GPU's {total / 2**30:.1f} are free, and "
                 f"gpu_memory_utilization={config.gpu_memory_utilization} keeps "
                 f"{(1 - config.gpu_memory_utilization) * total / 2**30:.1f} GiB back; free "
                 "the memory another model or engine holds, or raise gpu_memory_utilization") \
            if on_gpu_share else "raise kv_cache_memory_mb"
        raise RequestError(f"the KV-cache budget ({budget / 2**20:.0f} MiB) holds no block of "
                           f"{per_block / 2**20:.2f} MiB: {where}")
    return blocks
