"""Many LoRA adapters on one served base, in the same batch (Punica / S-LoRA's idea).

The engine wraps every attention and MLP projection of the base (and a Gated DeltaNet's) in
a `MultiLoraLinear` holding `max_loras` adapter slots (Aᵀ: slots × in × max_rank, Bᵀ: slots
× max_rank × out, a scale per slot; an adapter of lower rank fills its slot's leading ranks
and leaves zeros). Each step the engine says which slot each token row belongs to
(`AdapterSlots.rows`); a projection then adds (x A_slotᵀ) B_slotᵀ · scale to each adapted
row's base output: over several adapters, in one kernel call that reads each row's own slot
(`lathe.kernels.lora_bgmv`: the native op on CPU, Triton's where the kernel policy turns it
on) for a step of at most the largest decode bucket's rows, else in one batched matmul pair
over every row's own gathered A and B (Punica's BGMV) while those stay small
(`GATHER_ELEMENTS`), else one matmul pair per adapter over its rows (SGMV's segments); over
all rows when they share one adapter. Rows of the base model (slot -1) get nothing added.

A compiled decode step (`lathe.serve.decode_graph`) cannot take a Python list of rows: it
reads each row's slot from `row_slots`, a device tensor every projection shares, which the
engine fills before the step (padding rows -1), and adds each row's own delta by
`lathe.kernels.lora_bgmv`: one native call a projection on CPU, Triton's shrink and expand
where they are on, else gathers and masks the graph traces; adapters loaded or swapped
later are read by the same graphs, as the base weights are.

Adapters are peft folders (`adapter_config.json`, `adapter_model.safetensors`), read with
safetensors only and checked against the base when loaded: every LoRA weight must name a
projection the base has, with its shape, at a rank within `max_rank`; DoRA, biases and
modules_to_save are refused by name. Any number stay in host memory; a sequence takes its
adapter's slot when admitted, the least recently used idle adapter giving up its slot if
none is free (vLLM's max_loras and its CPU LoRA cache). An adapter unloaded while requests
use it leaves only when the last of them finishes, and every loaded adapter gets its own
prefix-cache root, so KV computed under one adapter is never reused under another (or
under a reload of the same name).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from lathe.core.checkpoint_files import checkpoint_file, read_json_object
from lathe.core.errors import CheckpointError
from lathe.kernels.lora_bgmv import fused_lora_bgmv, lora_bgmv
from lathe.model.config import ModelConfig
from lathe.model.families import adapter_renamed, language_model_weights
from lathe.model.gated_delta_net import GatedDeltaNet
from lathe.model.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ALL_LINEARS,
    DELTA_NET_LINEARS,
    PEFT_PREFIX,
    adapter_pairs,
    expert_adapters,
    split_fused_pairs,
)
from lathe.serve.half_weights import activation_dtype
from lathe.serve.request_checks import AdapterError
from lathe.serve.sequence import Sequence

# (slot, the token rows that slot's adapter applies to; None: every row of the forward)
Rows = list[tuple[int, Tensor | None]]
# rows over several adapters gather every row's own A and B and run one batched matmul
# pair (BGMV) while those gathered weights stay within this many floats per projection
# (rows × width × rank: a decode step's few rows, a small model's prefill); past it (a long
# prefill of a wide model) they loop over the adapters (SGMV's segments)
GATHER_ELEMENTS = 1 << 23
# the largest |weight| and scale an adapter may hold: trained LoRA weights are below ~1, and
# one past this (1e38 has been sent) overflows a bf16 row into Inf, and its neighbours' too
MAX_WEIGHT = 1e3


@dataclass
class LoraAdapter:
    """One adapter as read from its folder: per projection (module name) its A (r × in) and
    B (out × r), and its scale (alpha / r, or alpha / √r with rsLoRA)."""

    name: str
    path: Path
    rank: int
    scale: float
    weights: dict[str, tuple[Tensor, Tensor]]


class _Context:
    """The token rows of the forward in flight, per slot (None: no adapter applies), and
    for a few rows over several adapters, the rows and each one's slot, to gather."""

    rows: Rows | None = None
    gathered: tuple[Tensor, Tensor] | None = None


class MultiLoraLinear(nn.Module):
    """A base projection plus `slots` LoRA adapters, applied per token row."""

    def __init__(self, base: nn.Module, slots: int, rank: int, context: _Context,
                 row_slots: Tensor, dtype: torch.dtype) -> None:
        """`dtype`: the adapters', the activations' (a quantized or half base's weights are
        not)."""
        super().__init__()
        self.base, self.context = base, context
        weight = next(base.parameters(), None) if not hasattr(base, "weight") else base.weight
        device = weight.device if weight is not None else None
        self.in_features, self.out_features = base.in_features, base.out_features
        # stored transposed (Aᵀ: in × rank, Bᵀ: rank × out), so each matmul reads a
        # contiguous slot: a transposed view of a slot costs 30× more on CPU
        self.register_buffer("lora_a", torch.zeros(slots, self.in_features, rank, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots, rank, self.out_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("scale", torch.zeros(slots, device=device), persistent=False)
        self.register_buffer("row_slots", row_slots, persistent=False)  # one tensor for all

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        if torch.compiler.is_compiling():
            return self._static_rows(x, y)
        rows = self.context.rows
        if not rows:
            return y
        flat_x, flat_y = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        gathered = self.context.gathered
        if gathered is not None and len(flat_x) <= len(self.row_slots):
            # several adapters over a step's few rows: one kernel call, as a compiled step's
            fused = fused_lora_bgmv(flat_y, flat_x, self.lora_a, self.lora_b, self.scale,
                                    self.row_slots)
            if fused is not None:
                return fused.view(y.shape)
        if gathered is not None and len(gathered[0]) * max(self.in_features, self.out_features) \
                * self.lora_a.shape[-1] <= GATHER_ELEMENTS:  # one batched matmul pair
            index, slots = gathered
            xs = flat_x.index_select(0, index).to(self.lora_a.dtype)[:, None]
            delta = (xs @ self.lora_a[slots]) @ self.lora_b[slots]
            flat_y.index_add_(0, index, (delta[:, 0] * self.scale[slots, None]).to(
                flat_y.dtype))
            return y
        for slot, index in rows:
            if index is None:  # every row on this one adapter: no gather, no scatter
                delta = (flat_x.to(self.lora_a.dtype) @ self.lora_a[slot]) \
                    @ self.lora_b[slot] * self.scale[slot]
                flat_y += delta.to(flat_y.dtype)
                continue
            xs = flat_x.index_select(0, index).to(self.lora_a.dtype)
            delta = (xs @ self.lora_a[slot]) @ self.lora_b[slot] * self.scale[slot]
            flat_y.index_add_(0, index, delta.to(flat_y.dtype))
        return y

    def _static_rows(self, x: Tensor, y: Tensor) -> Tensor:
        """A compiled decode step's adapters, by `row_slots` (see the module docstring)."""
        flat_y = lora_bgmv(y.reshape(-1, self.out_features), x.reshape(-1, self.in_features),
                           self.lora_a, self.lora_b, self.scale, self.row_slots)
        return flat_y.view(y.shape)

    def load(self, slot: int, a: Tensor, b: Tensor, scale: float) -> None:
        self.clear(slot)
        rank = a.shape[0]
        self.lora_a[slot, :, :rank] = a.T.to(self.lora_a.dtype)
        self.lora_b[slot, :rank] = b.T.to(self.lora_b.dtype)
        self.scale[slot] = scale

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scale[slot] = 0.0


# what the config of an adapter's base must share with the served model's
BASE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "vocab_size")


def check_base(config_file: Path, base: object, served: dict) -> None:
    """When an adapter names its base as a local checkpoint folder, that base must be the
    served model's shape: an adapter trained on a shallower model of the same width would
    otherwise load without a shape error and change only some layers."""
    if not isinstance(base, str) or not (Path(base) / "config.json").is_file():
        return  # a hub id, or a folder not on this machine: the weight shapes still decide
    theirs = read_json_object(Path(base) / "config.json")
    differ = [f"{key} {theirs.get(key)!r} vs {served.get(key)!r}" for key in BASE_FIELDS
              if key in theirs and theirs.get(key) != served.get(key)]
    if differ:
        raise CheckpointError(f"{config_file}: its base_model_name_or_path {base} is not this "
                              f"model ({'; '.join(differ)}); serve it over its own base")


def read_adapter(name: str, path: str | Path, layers: dict[str, MultiLoraLinear],
                 max_rank: int, base: ModelConfig) -> LoraAdapter:
    """A peft adapter folder checked against the base's projections `layers` (module name
    -> layer) and the served model's config `base` (its HF config, and its family's class's
    module names and fused rows); `CheckpointError` naming the file, the weight and the fix
    when it does not fit."""
    path = Path(path)
    config_file, weights_file = (checkpoint_file(path, ADAPTER_CONFIG),
                                 checkpoint_file(path, ADAPTER_WEIGHTS))
    if not config_file.is_file() or not weights_file.is_file():
        raise CheckpointError(f"{path} is not a LoRA adapter folder: it needs {ADAPTER_CONFIG} "
                              f"and {ADAPTER_WEIGHTS} (peft's save_pretrained, or a lathe "
                              "LoRA run's final-adapter)")
    config = read_json_object(config_file)
    check_base(config_file, config.get("base_model_name_or_path"), base.to_hf_config())
    for key, wanted in (("use_dora", False), ("bias", "none"), ("modules_to_save", None)):
        if config.get(key, wanted) not in (wanted, [], {}):
            raise CheckpointError(f"{config_file}: {key}={config[key]!r} is not served; only "
                                  "plain LoRA on the projections is")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise CheckpointError(f"{config_file}: per-module {key} is not served")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or not isinstance(alpha, (int, float)) or rank < 1:
        raise CheckpointError(f"{config_file}: r and lora_alpha must be numbers (r >= 1), got "
                              f"r={rank!r}, lora_alpha={alpha!r}")
    if rank > max_rank:
        raise CheckpointError(f"{path}: rank {rank} is above --max-lora-rank {max_rank}; "
                              "raise it or serve a lower-rank adapter")
    try:
        tensors = load_file(weights_file)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{weights_file}: not a readable safetensors file ({error})") \
            from None
    for key in tensors:
        if key.rpartition(".lora_")[2] not in ("A.weight", "B.weight"):
            raise CheckpointError(f"{weights_file}: {key} is not a LoRA A or B weight; this "
                                  "server serves plain LoRA adapters only")
    if not tensors:
        raise CheckpointError(f"{weights_file}: no LoRA weights")
    try:  # a family's fused projections (Phi-3's qkv_proj) as the projections they stack,
        # and a multimodal base's language model's names as the text model's
        named = language_model_weights(
            {key.removeprefix(PEFT_PREFIX): t for key, t in tensors.items()})
        pairs = split_fused_pairs(
            adapter_pairs(adapter_renamed(named, base)),
            {module: layer.out_features for module, layer in layers.items()}, base)
    except ValueError as error:
        raise CheckpointError(f"{weights_file}: {error}") from None
    experts = expert_adapters(pairs)
    if experts:
        raise CheckpointError(f"{weights_file}: adapts a mixture of experts' stacked experts "
                              f"({experts[0]}, ...), which adapter slots do not serve; serve "
                              "the merged model (lathe export BASE --merge-lora ADAPTER --out "
                              "MERGED)")
    weights = {}
    for module, (a, b) in pairs.items():
        if module not in layers:
            raise CheckpointError(f"{weights_file}: {module!r} is not a projection of this base "
                                  f"that adapters may target ({', '.join(ALL_LINEARS)} of each "
                                  f"layer, {', '.join(DELTA_NET_LINEARS)} of a linear-attention "
                                  "one); was the adapter trained on another base, or on "
                                  "lm_head?")
        layer = layers[module]
        if a.shape != (rank, layer.in_features) or b.shape != (layer.out_features, rank):
            raise CheckpointError(
                f"{weights_file}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but "
                f"this base's {module} takes A ({rank}, {layer.in_features}) and B "
                f"({layer.out_features}, {rank}); the adapter belongs to another base")
        for label, tensor in (("A", a), ("B", b)):
            largest = tensor.abs().max().item()
            if not math.isfinite(largest):
                raise CheckpointError(f"{weights_file}: {module}'s LoRA {label} holds NaN or "
                                      "Inf; every request on it would return garbage")
            if largest > MAX_WEIGHT:
                raise CheckpointError(
                    f"{weights_file}: {module}'s LoRA {label} holds a weight of magnitude "
                    f"{largest:.3g}, past {MAX_WEIGHT:g}; trained LoRA weights are orders of "
                    "magnitude smaller (it would overflow in bf16)")
        weights[module] = (a, b)
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    if not 0 < abs(scale) <= MAX_WEIGHT:
        raise CheckpointError(f"{config_file}: lora_alpha={alpha!r} over r={rank} scales the "
                              f"update by {scale:g}; a served adapter's scale is in "
                              f"(0, {MAX_WEIGHT:g}]")
    return LoraAdapter(name, path, rank, float(scale), weights)


@dataclass
class _Loaded:
    adapter: LoraAdapter
    root: int  # its prefix-cache root
    slot: int | None = None  # its slot while resident
    users: int = 0  # admitted sequences on it that have not finished
    last_used: int = 0  # when a sequence last took it (for least-recently-used eviction)
    retiring: bool = False  # unloaded: gone once its users finish


class AdapterSlots:
    """The adapters a served base holds, by name: all of them in host memory, and up to
    `max_loras` in slots the projections read. A sequence takes its adapter's slot when
    the scheduler admits it (`activate`), loading the adapter into a free slot or into the
    least recently used one that no unfinished sequence holds; when every slot is held,
    the sequence waits."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int,
                 max_rows: int = 256, max_loaded: int | None = None) -> None:
        """`max_rows`: the most rows a compiled decode step has (its largest bucket);
        `max_loaded`: the most adapters held in host memory (None: no limit), past which
        adding one unloads the least recently used idle one."""
        self.config = model.config
        if max_loras < 1 or max_rank < 1 or (max_loaded is not None and max_loaded < 1):
            raise AdapterError(f"max_loras={max_loras}, max_lora_rank={max_rank} and "
                               f"max_loaded_loras={max_loaded} must be >= 1")
        self.max_loras, self.max_rank, self.max_loaded = max_loras, max_rank, max_loaded
        self.context = _Context()
        device, dtype = model.model.embed_tokens.weight.device, activation_dtype(model)
        self.row_slots = torch.full((max_rows,), -1, dtype=torch.long, device=device)
        self.layers: dict[str, MultiLoraLinear] = {}
        for name, module in list(model.named_modules()):
            targets = DELTA_NET_LINEARS if isinstance(module, GatedDeltaNet) else ALL_LINEARS
            for child_name, child in list(module.named_children()):
                if child_name in targets and not isinstance(child, MultiLoraLinear):
                    wrapped = MultiLoraLinear(child, max_loras, max_rank, self.context,
                                              self.row_slots, dtype)
                    setattr(module, child_name, wrapped)
                    self.layers[f"{name}.{child_name}"] = wrapped
        self.loaded: dict[str, _Loaded] = {}
        self._slots: list[str | None] = [None] * max_loras  # which adapter each slot holds
        self._clock = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return [name for name, entry in self.loaded.items() if not entry.retiring]

    @property
    def resident(self) -> list[str]:
        """The adapters in slots now, slot by slot (None: a free slot)."""
        return list(self._slots)

    def add(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check an adapter folder and hold it, ready for requests to name."""
        adapter = read_adapter(name, path, self.layers, self.max_rank, self.config)
        with self._lock:
            if name in self.loaded and not self.loaded[name].retiring:
                raise AdapterError(f"an adapter named {name!r} is already loaded; unload it "
                                   "first")
            if name in self.loaded:  # a retiring one still in use keeps its old entry
                raise AdapterError(f"the adapter {name!r} is being unloaded while requests "
                                   "finish on it; load it again once they have")
            if self.max_loaded is not None and len(self.names) >= self.max_loaded:
                self._evict_idle()
            self.loaded[name] = _Loaded(adapter, hash(("lora", name, next(self._clock))))
        return adapter

    def _evict_idle(self) -> None:
        """Unload the least recently used adapter no sequence holds (under the lock), or
        refuse when every one is in use."""
        idle = sorted((entry.last_used, name) for name, entry in self.loaded.items()
                      if not entry.retiring and entry.users == 0)
        if not idle:
            raise AdapterError(f"{self.max_loaded} adapters are loaded (max_loaded_loras) and "
                               "all are in use; unload one or retry later")
        entry = self.loaded[idle[0][1]]
        entry.retiring = True
        self._drop_if_done(idle[0][1], entry)

    def put(self, name: str, weights: dict[str, tuple[Tensor, Tensor]], scale: float) -> None:
        """Hold in-memory adapter weights (module name -> (A, B)) under `name`, replacing
        an idle adapter of that name — a training policy's current adapters, handed to its
        rollout engine each step. The replacement gets a new prefix-cache root, so no KV
        of the old weights is reused."""
        for module, (a, b) in weights.items():
            layer = self.layers.get(module)
            if layer is None or a.shape[1] != layer.in_features or \
                    b.shape[0] != layer.out_features or a.shape[0] > self.max_rank:
                raise AdapterError(f"adapter weights for {module!r} do not fit this base (A "
                                   f"{tuple(a.shape)}, B {tuple(b.shape)}, max rank "
                                   f"{self.max_rank})")
        adapter = LoraAdapter(name, Path(f"<memory:{name}>"), max(a.shape[0] for a, _ in
                                                                  weights.values()),
                              scale, weights)
        with self._lock:
            entry = self.loaded.get(name)
            if entry is not None and entry.users:
                raise AdapterError(f"the adapter {name!r} is in use by running requests")
            slot = entry.slot if entry is not None else None
            self.loaded[name] = _Loaded(adapter, hash(("lora", name, next(self._clock))), slot)
            if slot is not None:
                self._load(adapter, slot)

    def remove(self, name: str) -> None:
        """Unload `name`: new requests can no longer name it; it leaves its slot once the
        sequences using it finish."""
        with self._lock:
            entry = self.loaded.get(name)
            if entry is None or entry.retiring:
                raise AdapterError(f"no adapter named {name!r} is loaded")
            entry.retiring = True
            self._drop_if_done(name, entry)

    def root(self, name: str) -> int:
        """The prefix-cache root of adapter `name` (`AdapterError` if it is not loaded)."""
        with self._lock:
            entry = self.loaded.get(name)
            if entry is None or entry.retiring:
                raise AdapterError(f"no adapter named {name!r} is loaded")
            return entry.root

    def activate(self, name: str) -> int | None:
        """A sequence on adapter `name` is being admitted: the slot it reads, the adapter
        loaded into it if needed; None when every slot is held by unfinished sequences."""
        with self._lock:
            entry = self.loaded[name]
            if entry.slot is None:
                free = [slot for slot, held in enumerate(self._slots) if held is None]
                idle = sorted((self.loaded[held].last_used, slot)
                              for slot, held in enumerate(self._slots)
                              if held is not None and self.loaded[held].users == 0)
                if not free and not idle:
                    return None
                slot = free[0] if free else idle[0][1]
                if self._slots[slot] is not None:
                    self.loaded[self._slots[slot]].slot = None
                self._load(entry.adapter, slot)
                self._slots[slot], entry.slot = name, slot
            entry.users += 1
            entry.last_used = next(self._clock)
            return entry.slot

    def admit(self, seq: Sequence) -> bool:
        """The scheduler's admission check: a waiting sequence on an adapter may start only
        once it holds that adapter's slot."""
        if seq.adapter is None or seq.adapter_slot >= 0:
            return True
        slot = self.activate(seq.adapter)
        if slot is None:
            return False
        seq.adapter_slot = slot
        return True

    def release(self, name: str) -> None:
        """A sequence admitted on `name` has finished (or was aborted)."""
        with self._lock:
            entry = self.loaded[name]
            entry.users -= 1
            self._drop_if_done(name, entry)

    def _load(self, adapter: LoraAdapter, slot: int) -> None:
        for module, layer in self.layers.items():
            if module in adapter.weights:
                layer.load(slot, *adapter.weights[module], adapter.scale)
            else:
                layer.clear(slot)

    def _drop_if_done(self, name: str, entry: _Loaded) -> None:
        if entry.retiring and entry.users == 0:
            if entry.slot is not None:
                for layer in self.layers.values():
                    layer.clear(entry.slot)
                self._slots[entry.slot] = None
            del self.loaded[name]

    @contextmanager
    def rows(self, slots: list[int], device: torch.device
             ) -> Iterator[Callable[[list[int]], None]]:
        """Within it, token row i of a forward belongs to adapter slot `slots[i]` (-1: the
        base alone). It yields what to call when the forward goes on with some of its rows
        alone (`PagedBatch.narrow`: a Gemma 4 E2B's KV-sharing layers), each keeping its
        slot."""
        self._route(slots, device)
        try:
            yield lambda kept: self._route([slots[row] for row in kept], device)
        finally:
            self.context.rows = self.context.gathered = None

    def _route(self, slots: list[int], device: torch.device) -> None:
        """What the projections read for rows on `slots`: the context, and the slot of each
        row where the rows are few (a compiled decode step's, or the fused kernel's)."""
        if len(slots) <= len(self.row_slots):
            padded = slots + [-1] * (len(self.row_slots) - len(slots))
            self.row_slots.copy_(torch.tensor(padded), non_blocking=True)
        present = sorted(set(slots))
        self.context.gathered = None
        if len(present) <= 1:
            self.context.rows = [(present[0], None)] if present and present[0] >= 0 else None
            return
        index = torch.tensor(slots, device=device)
        self.context.rows = [(slot, (index == slot).nonzero()[:, 0])
                             for slot in present if slot >= 0] or None
        adapted = (index >= 0).nonzero()[:, 0]
        if self.context.rows and len(self.context.rows) > 1:
            self.context.gathered = (adapted, index[adapted])
