"""What each sequence's linear-attention layers (Qwen3.5's Gated DeltaNet) carry from one
engine step to the next, and one step's view of it.

Where an attention layer keeps keys and values per token in the paged slabs, a linear-
attention layer keeps one fixed-size state per sequence: its short convolution's last inputs
and its delta rule's (value heads, key width, value width) matrix. `RecurrentStates` holds
them per layer, a row for each row of the `ModelRunner`'s block tables (a sequence's row is
its state's index) and a scratch row that a compiled decode step's padding rows write
(`lathe.serve.decode_graph`, which reads and writes the rows in place), and grows with those
rows — into new tensors, which the compiled steps no longer serve. A state is the sequence's
after the tokens the engine has computed for it, so a sequence starts fresh at position 0 —
a new one, or one recomputed after a preemption — or from a snapshot. In a speculative step
the state would advance through drafts the target then rejects, so a drafted sequence's
tokens run token by token keeping the states after each (`StateSpans.candidates`), and once
the drafts are verified the row takes those after the last accepted one (`settle`).

A cached prefix's keys and values have no linear-attention state at their end, so prefix
caching keeps states apart (vLLM's "align" mode for hybrid models, in short): each prefill
chunk's states at the last block boundary it crosses, and at every multiple of the snapshot
stride it crosses (a long shared system prompt then resumes near its end), are snapshotted,
all layers' together, under the hash of the block that ends there, and so are a decoding
sequence's at each boundary it reaches, its latest replacing its last (`StateSnapshots`, the
most recent few, least recently used first out). A new prompt then starts from cached blocks
only up to a block whose snapshot is held (`BlockManager.allocate`'s `keep`), its states
copied in from it. A prompt that grows a conversation (the next turn of a chat or an agent's
loop) resumes at the last boundary of the answer before it, instead of at token 0.

`StateSpans` is one step's layout: where each sequence's tokens lie in the step's row, its
state row, whether it starts fresh, and where (if anywhere) a snapshot is taken. `run` gives
a layer's computation the tokens in batches of sequences with as many tokens and the same
freshness — a step's decodes together, and the equal prompts of n samples or of a GRPO group
— their states gathered and scattered back by row; a chunk that snapshots before its end
runs in pieces, one a round, each ending at a snapshot."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

from lathe.model.config import ModelConfig
from lathe.model.kv_cache import RecurrentStep


class RecurrentStates:
    def __init__(self, config: ModelConfig, rows: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        """The convolution's inputs in `dtype` (the KV cache's), the rule's state in float32
        (as it is computed); a row past the sequences' (`scratch`) for a compiled step's
        padding rows to write."""
        self.conv_shape, self.state_shape = recurrent_shapes(config)
        self.layers = [i for i in range(config.n_layers) if config.is_linear(i)]
        self.conv = {i: torch.zeros(rows + 1, *self.conv_shape, device=device, dtype=dtype)
                     for i in self.layers}
        self.state = {i: torch.zeros(rows + 1, *self.state_shape, device=device,
                                     dtype=torch.float32) for i in self.layers}

    @property
    def scratch(self) -> int:
        """The padding rows' state row (owned by no sequence), after the sequences'."""
        return len(next(iter(self.state.values()))) - 1

    def grow(self, rows: int) -> None:
        """Room for `rows` sequences, the states held kept (new tensors: a compiled step
        built over the old ones no longer serves)."""
        for table in (self.conv, self.state):
            for i, held in table.items():
                table[i] = torch.cat((held, held.new_zeros(rows + 1 - len(held),
                                                           *held.shape[1:])))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for table in (self.conv, self.state) for t in table.values())

    def restore(self, row: int, snapshot: Snapshot) -> None:
        """Start `row` from a kept prefix's states."""
        for i, (conv, state) in snapshot.items():
            self.conv[i][row], self.state[i][row] = conv, state

    @staticmethod
    def bytes_per_sequence(config: ModelConfig, dtype: torch.dtype) -> int:
        """What one sequence's states take, every linear-attention layer's."""
        conv, state = recurrent_shapes(config)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return config.linear_layer_count * (conv[0] * conv[1] * itemsize + 4 * state[0]
                                            * state[1] * state[2])


# every linear-attention layer's (convolution inputs, rule state) of one sequence, by layer
Snapshot = dict[int, tuple[Tensor, Tensor]]


class StateSnapshots:
    """Snapshots of the states at the end of cached prefixes, keyed by the hash of the block
    that ends there; the `capacity` most recently stored or used ones kept."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: OrderedDict[int, Snapshot] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self.held

    def __len__(self) -> int:
        return len(self.held)

    def put(self, key: int, snapshot: Snapshot) -> None:
        self.held[key] = snapshot
        self.held.move_to_end(key)
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)

    def discard(self, key: int) -> None:
        self.held.pop(key, None)

    def get(self, key: int) -> Snapshot:
        snapshot = self.held.get(key)
        if snapshot is None:
            raise RuntimeError(f"no linear-attention states kept for block hash {key}: the "
                               "scheduler admitted a cached prefix without them")
        self.held.move_to_end(key)
        return snapshot

    def clear(self) -> None:
        self.held.clear()


def recurrent_shapes(config: ModelConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One sequence's (convolution inputs, rule state) shapes in a linear-attention layer."""
    return ((config.linear_conv_kernel - 1, config.linear_conv_channels),
            (config.linear_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim))


@dataclass
class StateSpans:
    """One step's sequences as the states see them: (start in the step's row, length,
    state row, fresh, snapshots) each, in row order — snapshots: after how many of its
    tokens its states are kept, ascending (none: nowhere)."""

    states: RecurrentStates
    spans: list[tuple[int, int, int, bool, tuple[int, ...]]]
    # state rows whose tokens end in drafts: their states after each token are kept until
    # `settle` says how many were accepted
    drafted: frozenset[int] = frozenset()
    # (state row, after how many of its tokens) -> the snapshot
    captured: dict[tuple[int, int], Snapshot] = field(default_factory=dict)
    # a drafted row's states after each of its tokens, by layer (token first)
    candidates: dict[int, Snapshot] = field(default_factory=dict)

    @cached_property
    def rounds(self) -> list[list[tuple[Tensor, Tensor, list[int], bool, bool]]]:
        """The step's sequences in batches the layers run at once: those of one length,
        freshness and drafting together (a step's decodes; n samples' or a GRPO group's equal
        prompts), each batch as where its tokens lie in the step's row (sequences × length),
        its state rows (on the device and on the host), whether it starts fresh and whether
        its tokens end in drafts. A chunk snapshotted before its end runs in pieces, each
        ending at a snapshot: its first piece in the first round, its next in the next.
        Built once for all the step's layers."""
        pieces: list[list[tuple[int, int, int, bool]]] = []
        for start, length, row, fresh, cuts in self.spans:
            ends = [cut for cut in cuts if cut < length] + [length]
            for number, (begin, end) in enumerate(zip([0, *ends], ends, strict=False)):
                if number == len(pieces):
                    pieces.append([])
                pieces[number].append((start + begin, end - begin, row,
                                       fresh and number == 0))
        return [self._batches(round_) for round_ in pieces]

    def _batches(self, spans: list[tuple[int, int, int, bool]]
                 ) -> list[tuple[Tensor, Tensor, list[int], bool, bool]]:
        batches: dict[tuple[int, bool, bool], list[tuple[int, int]]] = {}
        for start, length, row, fresh in spans:
            batches.setdefault((length, fresh, row in self.drafted), []).append((start, row))
        device = next(iter(self.states.state.values())).device
        out = []
        for (length, fresh, drafted), members in batches.items():
            starts = torch.tensor([start for start, _ in members], device=device)
            rows = [row for _, row in members]
            out.append((starts[:, None] + torch.arange(length, device=device),
                        torch.tensor(rows, device=device), rows, fresh, drafted))
        return out

    @cached_property
    def snapshot_rounds(self) -> dict[int, list[tuple[int, int]]]:
        """After each round, the (state row, tokens) snapshots it completes."""
        out: dict[int, list[tuple[int, int]]] = {}
        for _, _, row, _, cuts in self.spans:
            for number, cut in enumerate(cuts):
                out.setdefault(number, []).append((row, cut))
        return out

    def run(self, layer_idx: int, inputs: tuple[Tensor, ...], step: RecurrentStep) -> Tensor:
        """`KVCache.recurrent` over this step's sequences (inputs (1, T, ·)), keeping the
        snapshots the spans ask for in `captured`."""
        conv, state = self.states.conv[layer_idx], self.states.state[layer_idx]
        out: Tensor | None = None
        for number, groups in enumerate(self.rounds):
            for at, rows, host_rows, fresh, drafted in groups:
                result, (new_conv, new_state) = step(
                    tuple(t[0, at] for t in inputs), None if fresh else (conv[rows], state[rows]),
                    every=drafted)
                if drafted:
                    for i, row in enumerate(host_rows):
                        self.candidates.setdefault(row, {})[layer_idx] = (new_conv[i],
                                                                          new_state[i])
                    new_conv, new_state = new_conv[:, -1], new_state[:, -1]
                conv[rows], state[rows] = new_conv.to(conv.dtype), new_state
                if out is None:
                    out = result.new_empty(1, inputs[0].shape[1], *result.shape[2:])
                out[0, at] = result
            self.capture(number, [layer_idx])
        assert out is not None, "a step with no tokens"
        return out

    def capture(self, number: int, layers: list[int]) -> None:
        """Keep the snapshots round `number` completes, of `layers`' states as they are
        now."""
        for row, cut in self.snapshot_rounds.get(number, []):
            taken = self.captured.setdefault((row, cut), {})
            for i in layers:
                taken[i] = (self.states.conv[i][row].clone(), self.states.state[i][row].clone())

    def settle(self, row: int, kept: int) -> None:
        """A drafted row's states after its first `kept` tokens (the last sampled one and
        the drafts accepted after it), in place of those after all of them."""
        for layer, (conv, state) in self.candidates.pop(row, {}).items():
            self.states.conv[layer][row] = conv[kept - 1]
            self.states.state[layer][row] = state[kept - 1]
