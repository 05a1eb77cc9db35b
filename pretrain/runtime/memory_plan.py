"""What one training step holds per rank, predicted before any weight is loaded.

A plan has two halves. The *model states* — weights, gradients, optimizer state — follow
from parameter counts and the launch: which of them each strategy shards over the ranks
and in which dtype it keeps them (DDP: everything whole, plus its gradient buckets; ZeRO-1
shards the optimizer, ZeRO-2 the gradients too, ZeRO-3 and FSDP2 the weights as well, and
gather a few layers' full weights while they compute). The *step's transient memory* —
activations kept for the backward, the LM head's chunks, workspace — is not computed from
a formula but measured: the model is built from its config under `FakeTensorMode` (no
weight exists anywhere) and one micro-batch's forward and backward run through it while
a dispatch mode counts every live tensor's bytes, gradients counted as they arrive at the
share of them the strategy keeps. So activation checkpointing, LoRA, the chunked head,
attention's saved tensors and autocast's weight copies are whatever the code really does,
for a 70B config as for a tiny one, in seconds on a CPU.

`plan_memory` is the one entry: `lathe plan` prints it for a recipe and a launch file,
every stage prints it at start, and `largest_micro_batch` searches the micro-batch that
fits a memory size.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from lathe.core.errors import ConfigError, LatheError
from lathe.kernels.dispatch import KERNELS, kernels_off
from lathe.kernels.fused_ce import linear_cross_entropy, linear_token_logprobs
from lathe.model.config import ModelConfig
from lathe.model.head_ops import LabelLogprobs
from lathe.model.lora import LoraSection, apply_lora
from lathe.model.transformer import Transformer
from lathe.pretrain.runtime.converters import enable_activation_checkpointing
from lathe.pretrain.runtime.precision import compute_dtype

Strategy = Literal["single", "ddp", "fsdp2", "zero1", "zero2", "zero3"]
STRATEGIES = ("single", "ddp", "fsdp2", "zero1", "zero2", "zero3")
GIB = 2**30
# what returns freed blocks to the system at once, as the bench and tests measure with
RETAIN_OFF = "MALLOC_MMAP_THRESHOLD_=131072"
# the kernels a plan traces the references of (see plan_memory)
OFF_IN_TRACE = tuple(name for name in KERNELS if name != "grouped_matmul")
ZERO3_MAX_LIVE_PARAMETERS = 10**9  # DeepSpeed's default stage3_max_live_parameters


class PlanError(LatheError):
    """The model runs an op that fake tensors cannot (a data-dependent shape): the step
    cannot be traced."""


@dataclass(frozen=True)
class Parallelism:
    """How a launch keeps the model: `strategy` over `processes` ranks, `mixed_precision`
    as accelerate names it, on `device` ("cuda" or "cpu": fused optimizers and CUDA's
    allocator differ), ZeRO's optimizer state offloaded to host memory or not."""

    strategy: Strategy = "single"
    processes: int = 1
    mixed_precision: str = "no"
    device: str = "cpu"
    offload_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy={self.strategy!r}: choose one of {', '.join(STRATEGIES)}")
        if self.processes < 1 or (self.strategy == "single" and self.processes != 1):
            raise ConfigError(f"processes={self.processes} with strategy={self.strategy}: "
                              "a single-process launch has 1, the others at least 1")

    def describe(self) -> str:
        name = {"single": "one process", "ddp": "DDP", "fsdp2": "FSDP2", "zero1": "ZeRO-1",
                "zero2": "ZeRO-2", "zero3": "ZeRO-3"}[self.strategy]
        ranks = "" if self.strategy == "single" else f" × {self.processes} ranks"
        return (f"{name}{ranks}, {self.mixed_precision if self.mixed_precision != 'no' else 'fp32'}"
                f" on {self.device}" + (", optimizer offloaded" if self.offload_optimizer else ""))


def deepspeed_buckets(dim: int) -> dict[str, int]:
    """DeepSpeed's communication buckets for a model of width `dim`, in elements (the sizes
    transformers' Trainer gives "auto"): DeepSpeed's own defaults (5e8-element reduce
    buckets) allocate 1 GB (bf16) per bucket whatever the model, the main cost of ZeRO-2
    for a small one."""
    return {"reduce_bucket_size": dim * dim,
            "stage3_prefetch_bucket_size": int(0.9 * dim * dim),
            "stage3_param_persistence_threshold": 10 * dim}


def parallelism_from_launch_file(path: str | Path, device: str | None = None) -> Parallelism:
    """The `Parallelism` an accelerate launch config (`accelerate launch --config_file`)
    sets up: the YAML files under recipes/accelerate, or any `accelerate config` wrote."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--launch {path}: no such file; pass an accelerate config such as "
                          "recipes/accelerate/8gpu-zero3.yaml")
    try:
        launch = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--launch {path}: not YAML ({e})") from None
    if not isinstance(launch, dict):
        raise ConfigError(f"--launch {path}: expected a mapping of accelerate settings")
    kind = str(launch.get("distributed_type", "NO")).upper()
    processes = int(launch.get("num_processes", 1) or 1)
    mixed = str(launch.get("mixed_precision", "no") or "no")
    device = device or ("cpu" if launch.get("use_cpu") or kind == "MULTI_CPU"
                        or path.name.startswith("cpu") else "cuda")
    offload = False
    if kind == "DEEPSPEED":
        ds = launch.get("deepspeed_config") or {}
        stage = int(ds.get("zero_stage", 2))
        if stage not in (1, 2, 3):
            raise ConfigError(f"--launch {path}: deepspeed_config.zero_stage={stage}; lathe "
                              "plans ZeRO stages 1, 2 and 3")
        strategy: Strategy = f"zero{stage}"  # type: ignore[assignment]
        offload = str(ds.get("offload_optimizer_device", "none")) not in ("none", "None")
    elif kind == "FSDP":
        strategy = "fsdp2"
    elif processes > 1:
        strategy = "ddp"
    else:
        strategy, processes = "single", 1
    return Parallelism(strategy, processes, mixed, device, offload)


def parallelism_of_setup(setup: dict[str, Any], device: str) -> Parallelism:
    """The `Parallelism` of a running launch (`lathe.pretrain.runtime.launch.describe`)."""
    kind, processes = setup["distributed_type"], setup["num_processes"]
    if kind == "DEEPSPEED":
        strategy: Strategy = f"zero{setup['zero_stage']}"  # type: ignore[assignment]
    elif kind == "FSDP":
        strategy = "fsdp2"
    elif processes > 1:
        strategy = "ddp"
    else:
        strategy = "single"
    return Parallelism(strategy, processes, setup["mixed_precision"], device)


@dataclass(frozen=True)
class StepShape:
    """One micro-batch of one stage as the policy sees it: `rows` sequences of `length`
    tokens (DPO's chosen and rejected are two rows per pair), through `head` — "loss" (mean
    cross-entropy: pretraining, SFT, distillation's student), "logprobs" (per-token
    log-probabilities: DPO, GRPO) or "score" (a sequence classifier's score head: a reward
    model). `grad_accum` > 1 keeps gradients between micro-batches.
    `packed` rows hold several documents, each attending only to itself (attention then
    takes a mask: on CPU SDPA's math path, which keeps each layer's attention weights).
    `frozen_bytes` is what the stage holds beside the policy per rank (a reference or
    teacher's weights), `kv_cache_bytes` a rollout engine's cache, `evaluation_bytes` what
    it holds between steps only (the KV cache of the engine its task accuracy is generated
    with)."""

    rows: int
    length: int
    head: Literal["loss", "logprobs", "score"] = "loss"
    grad_accum: int = 1
    frozen_bytes: int = 0
    kv_cache_bytes: int = 0
    evaluation_bytes: int = 0
    packed: bool = False


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's peak during a training step, by what holds it (bytes); `loading`, what a
    rank holds while the stage loads the whole fp32 weights (beside the checkpoint's
    tensors they are read from) before the launch shards them (FSDP2, ZeRO-3);
    `evaluating`, what it holds while generating between steps. The peak is the largest
    of the three. `host`: when the device is the CPU, what the process holds beside its
    tensors — the stage's data, its tokenizer — measured when a run prepares."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    kv_cache: int
    workspace: int
    parallelism: Parallelism
    shape: StepShape
    params: int
    trainable: int
    loading: int = 0
    evaluating: int = 0
    host: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def step(self) -> int:
        return sum(self.parts().values())

    @property
    def total(self) -> int:
        return max(self.step, self.loading, self.evaluating + self.host)

    def parts(self) -> dict[str, int]:
        return {"weights": self.weights, "gradients": self.gradients,
                "optimizer state": self.optimizer, "activations": self.activations,
                "logits / loss": self.logits, "KV cache": self.kv_cache,
                "workspace": self.workspace, "host data": self.host}

    def table(self) -> str:
        shape = self.shape
        lines = [f"memory plan, per rank: {self.parallelism.describe()}; "
                 f"{self.params / 1e6:,.1f}M parameters ({self.trainable / 1e6:,.2f}M "
                 f"trained); micro-batch {shape.rows} × {shape.length} tokens"]
        lines += [f"  {name:<16} {gib(value):>9}" for name, value in self.parts().items()
                  if value]
        if self.total > self.step:
            lines.append(f"  {'a step':<16} {gib(self.step):>9}")
        if self.loading > self.step:
            lines.append(f"  {'loading':<16} {gib(self.loading):>9}  (whole fp32 weights "
                         "and the checkpoint's, before the launch shards them)")
        if self.evaluating + self.host > self.step:
            lines.append(f"  {'evaluating':<16} {gib(self.evaluating + self.host):>9}  "
                         "(weights, optimizer state and the task evaluation's KV cache)")
        lines.append(f"  {'peak':<16} {gib(self.total):>9}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def gib(count: int) -> str:
    """`count` bytes for a reader: GiB, or MiB below one GiB."""
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 2**20:.1f} MiB"


def memory_line(report: dict[str, float]) -> str:
    """A run's measured peak beside its plan (`Runtime.memory_report`), for summaries; on
    a CPU whose allocator kept freed blocks resident, a peak past the plan says why."""
    planned = f" (planned {report['plan_gib']:.2f} GiB)" if "plan_gib" in report else ""
    line = f"peak memory {report['peak_gib']:.2f} GiB a rank{planned}"
    if report.get("allocator_retains") and report["peak_gib"] > 1.15 * report.get(
            "plan_gib", float("inf")):
        line += (" — on a CPU glibc keeps freed blocks resident (its mmap threshold grows "
                 f"after each free); {RETAIN_OFF} measures the step as a GPU's allocator "
                 "would, at some cost in speed")
    return line


def plan_memory(config: ModelConfig, shape: StepShape, parallelism: Parallelism, *,
                lora: LoraSection | None = None, activation_checkpointing: bool = False,
                z_loss: float = 0.0) -> MemoryPlan:
    """The per-rank peak of one training step of `config` under `parallelism`: the larger
    of the backward's peak (activations still kept, gradients arriving) and the optimizer
    step's (every gradient, the step's temporaries)."""
    mixed = compute_dtype(parallelism.mixed_precision)
    with torch.device("meta"):  # adapters are injected here: peft cannot swap fake weights
        model = Transformer(config)
        if lora is not None and lora.enabled:
            apply_lora(model, replace(lora, qlora=False))
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    # the meta weights, made fake here, run through the references whatever the kernel
    # policy: a kernel launched on fake tensors (Triton under LATHE_KERNELS=force) would read
    # storage they do not have. Torch's own grouped GEMM stays on: fake tensors run it, and
    # the experts' reference loop splits by counts it would have to read
    with FakeTensorMode(allow_non_fake_inputs=True), kernels_off(*OFF_IN_TRACE):
        model.to_empty(device="cpu")
        model.tie_weights()
        states = _model_states(model, parallelism)
        fake_log = logging.getLogger("torch._subclasses.fake_tensor")
        level = fake_log.level
        fake_log.setLevel(logging.CRITICAL)  # a refused op is said once, by PlanError
        try:
            step = _trace_step(model, shape, states.grad_factor, mixed, z_loss)
            head = _trace_head(model, shape, mixed, z_loss)
        except (RuntimeError, NotImplementedError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
            raise PlanError(f"a step of this {config.family} model cannot be traced on fake "
                            f"tensors ({reason}); no memory plan for it") from None
        finally:
            fake_log.setLevel(level)
    grads_whole = int(states.grad_factor * states.trainable)
    backward = step.live + step.extra + states.workspace + states.gathered
    at_step = grads_whole + states.step_temp + states.workspace
    gradients, activations, logits, workspace = (
        (int(step.extra), step.live - min(head, step.live), min(head, step.live),
         states.workspace + states.gathered) if backward >= at_step else
        (grads_whole, 0, 0, states.workspace + states.step_temp))
    return MemoryPlan(
        weights=states.weights + shape.frozen_bytes, gradients=gradients,
        optimizer=states.optimizer, activations=activations, logits=logits,
        kv_cache=shape.kv_cache_bytes, workspace=workspace, parallelism=parallelism,
        shape=shape, params=states.params, trainable=states.trainable,
        loading=8 * states.params + shape.frozen_bytes,
        evaluating=(states.weights + shape.frozen_bytes + states.optimizer + states.workspace
                    + shape.kv_cache_bytes + shape.evaluation_bytes),
        notes=states.notes)


def frozen_weight_bytes(config: ModelConfig, parallelism: Parallelism) -> int:
    """What a frozen model (a reference, a teacher) costs a rank once
    `Runtime.prepare_frozen` has placed it: fp32, sharded by FSDP2; DeepSpeed casts it to
    the launch's half precision and ZeRO-3 partitions it."""
    params = config.num_params()
    if parallelism.strategy == "fsdp2":
        return 4 * params // parallelism.processes
    if parallelism.strategy.startswith("zero"):
        module = 2 if parallelism.mixed_precision in ("bf16", "fp16") else 4
        return module * params // (parallelism.processes if parallelism.strategy == "zero3" else 1)
    return 4 * params


def largest_micro_batch(fits_in: int, plan_for: Callable[[int], MemoryPlan],
                        limit: int = 4096) -> int:
    """The largest micro-batch whose plan's peak is at most `fits_in` bytes (0: not even
    one); `plan_for(micro_batch)` builds a plan. Peaks grow with the micro-batch, so a
    doubling then a bisection find it in O(log) plans."""
    if plan_for(1).total > fits_in:
        return 0
    low, high = 1, 2
    while high <= limit and plan_for(high).total <= fits_in:
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if plan_for(middle).total <= fits_in else (low, middle)
    return low


@dataclass(frozen=True)
class _States:
    params: int
    trainable: int
    weights: int
    grad_factor: float  # bytes a rank keeps per element of gradient, as gradients arrive
    optimizer: int
    workspace: int  # held through the step (DDP's buckets, ZeRO's gradient partitions)
    gathered: int  # sharded weights gathered whole through forward and backward
    step_temp: int  # the optimizer step's temporaries
    notes: tuple[str, ...]


def _model_states(model: Transformer, par: Parallelism) -> _States:
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n = par.processes
    half = par.mixed_precision in ("bf16", "fp16")
    notes: list[str] = []
    layer = max(sum(p.numel() for p in block.parameters()) for block in model.model.layers)
    outside_layers = params - sum(p.numel() for p in model.model.layers.parameters())
    adam = 8 * trainable  # AdamW's two fp32 moments
    # CPU AdamW runs tensor by tensor, two fp32 temporaries of each (sqrt, then its
    # quotient); CUDA's is fused in place
    step_temp = 0 if par.device == "cuda" else 8 * max(
        (p.numel() for p in model.parameters() if p.requires_grad), default=0)
    if par.strategy in ("single", "ddp"):
        weights, optimizer, grad_factor, workspace, gathered = 4 * params, adam, 4.0, 0, 0
        if par.strategy == "ddp":
            workspace = 4 * trainable
            notes.append("DDP keeps a bucket copy of every gradient (gradient_as_bucket_view"
                         " is off)")
    elif par.strategy == "fsdp2":
        weights, optimizer, grad_factor = 4 * params // n, adam // n, 4.0 / n
        width = 2 if half else 4
        # the root's own weights (embedding, head, final norm) stay gathered through its
        # forward and backward; a block computes while the next is gathered into a staging
        # buffer and copied out; a block's gradients wait whole, and flattened, for their
        # reduce-scatter
        workspace, gathered = 0, width * (outside_layers + 5 * layer)
        step_temp //= n
    else:
        stage = int(par.strategy[-1])
        module = 2 if half else 4  # DeepSpeed casts the module to bf16/fp16
        master = 4 * trainable // n  # its fp32 partition, kept even for an fp32 module
        weights = module * params // (n if stage == 3 else 1) + master
        optimizer = 0 if par.offload_optimizer else adam // n
        # ZeRO-1 keeps whole gradients to the step; ZeRO-2/3 reduce each as it arrives
        grad_factor = float(module) if stage == 1 else 0.0
        buckets = deepspeed_buckets(model.config.dim)
        # gradients reduce through a bucket into a partition kept across steps, read by the
        # optimizer through an fp32 copy
        workspace = module * buckets["reduce_bucket_size"] + (module + 4) * trainable // n
        gathered = 0
        if stage == 3:
            # a gathered weight stays gathered while it is used again within
            # stage3_max_reuse_distance and fewer than stage3_max_live_parameters are (both
            # 1e9 by default): a model under a billion parameters is whole through the
            # forward and backward, a larger one holds a billion at a time
            gathered = module * min(params, ZERO3_MAX_LIVE_PARAMETERS)
            notes.append(f"ZeRO-3 keeps up to {ZERO3_MAX_LIVE_PARAMETERS:.0e} gathered "
                         "parameters (stage3_max_live_parameters); lower it to trade speed "
                         "for memory")
        step_temp = 0 if par.device == "cuda" else 8 * trainable // n  # one flat partition
        if par.offload_optimizer:
            notes.append(f"optimizer state in host memory: {gib(adam // n)} per rank")
    return _States(params, trainable, weights, grad_factor, optimizer, workspace, gathered,
                   step_temp, tuple(notes))


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage an op creates until it is freed, plus `extra`
    (gradients, counted as they arrive at the share a rank keeps); `live` and `extra` are
    their values at the peak of the two together once the mode exits."""

    def __init__(self, extra: float = 0.0) -> None:
        super().__init__()
        self.now, self.extra_now = 0, extra
        self.live, self.extra = 0, extra
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _free(self, size: int) -> None:
        self.now -= size

    def note(self) -> None:
        if self.now + self.extra_now > self.live + self.extra:
            self.live, self.extra = self.now, self.extra_now

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        for t in tree_leaves((args, kwargs)):
            # a storage an op reads before any op made it (a weight, an input) is not new
            # when a view of it comes out (a weight's transpose)
            if isinstance(t, torch.Tensor) and t.untyped_storage() not in self._seen:
                self._seen[t.untyped_storage()] = 0
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            out = _grouped_mm_output(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage not in self._seen:
                    size = storage.nbytes()
                    self._seen[storage] = size
                    self.now += size
                    weakref.finalize(storage, self._free, size)
        self.note()
        return out


def _grouped_mm_output(a: Tensor, b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> Tensor:
    """What `aten._grouped_mm` returns (a mixture of experts' grouped GEMM, and its
    backward's), made without running it: its fake kernel takes bf16 alone, where the CPU
    runs float32 too. The shapes are its own: ragged rows (2D × 3D), ragged contraction
    (2D × 2D, the weights' gradient), ragged columns (3D × 2D), or batched (3D × 3D)."""
    if a.dim() == 2 and b.dim() == 2:
        shape = (offs.size(0), a.size(0), b.size(1))
    elif a.dim() == 2:
        shape = (a.size(0), b.size(-1))
    elif b.dim() == 2:
        shape = (a.size(1), b.size(1))
    else:
        shape = (a.size(0), a.size(1), b.size(-1))
    return torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)


def _counting(leaves: list[Tensor], grad_factor: float, extra: float = 0.0) -> tuple[
        _LiveBytes, list[Any]]:
    """A counter whose `extra` grows by `grad_factor` bytes per element of each gradient
    that reaches one of `leaves`; the gradient itself is dropped (the strategy decides what
    a rank keeps of it, not the trace)."""
    counter = _LiveBytes(extra)

    def arrived(leaf: Tensor) -> None:
        counter.extra_now += grad_factor * leaf.numel()
        counter.note()
        leaf.grad = None

    return counter, [leaf.register_post_accumulate_grad_hook(arrived) for leaf in leaves]


def _trace_step(model: Transformer, shape: StepShape, grad_factor: float,
                mixed: torch.dtype, z_loss: float) -> _LiveBytes:
    """Forward and backward of one micro-batch; gradients kept from earlier micro-batches
    (grad_accum > 1) are there from the start."""
    ids = torch.zeros(shape.rows, shape.length, dtype=torch.long)
    documents = (torch.arange(shape.length) >= shape.length // 2).long().expand_as(ids) \
        if shape.packed else None
    trained = [p for p in model.parameters() if p.requires_grad]
    kept = grad_factor * sum(p.numel() for p in trained) if shape.grad_accum > 1 else 0.0
    counter, hooks = _counting(trained, 0.0 if kept else grad_factor, kept)
    with counter, _autocast(mixed):
        if shape.head == "loss":
            out = model(ids, labels=ids, return_logits=False, z_loss=z_loss,
                        documents=documents).loss
        elif shape.head == "score":
            out = model(ids, documents=documents).logits.float().sum()
        else:
            out = model(ids, head_op=LabelLogprobs(ids), documents=documents).head.sum()
        out.backward()
    for hook in hooks:
        hook.remove()
    return counter


def _trace_head(model: Transformer, shape: StepShape, mixed: torch.dtype,
                z_loss: float) -> int:
    """The LM head's own transient peak, gradients aside: its forward and backward on one
    micro-batch's final hidden states (the whole logits where the head is not chunked);
    a score head's (rows × tokens × labels) is nothing beside the decoder's."""
    if shape.head == "score":
        return 0
    rows = shape.rows * shape.length
    hidden = torch.zeros(shape.rows, shape.length, model.config.dim, dtype=mixed,
                         requires_grad=True)
    labels = torch.zeros(shape.rows, shape.length, dtype=torch.long)
    weight = model.head_weight().detach().to(mixed).requires_grad_()
    counter, hooks = _counting([hidden, weight], 0.0)
    softcap = model.config.final_softcap
    with counter, _autocast(mixed):
        if not model.chunked_head:
            logits = model.compute_logits(hidden)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                     labels.flatten())
        elif shape.head == "loss":
            loss, _ = linear_cross_entropy(hidden.view(rows, -1), weight, labels.view(-1),
                                           z_loss=z_loss, softcap=softcap)
        else:
            loss = linear_token_logprobs(hidden.view(rows, -1), weight, labels.view(-1),
                                         softcap=softcap).sum()
        loss.backward()
    for hook in hooks:
        hook.remove()
    return counter.live


def _autocast(dtype: torch.dtype) -> torch.autocast:
    return torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
