"""Decode steps at static shapes, compiled once per shape (vLLM's CUDA-graph capture,
gpt-fast's compiled decode).

A decode-only step is padded to the smallest batch bucket that holds it (1, 2, 4, 8, 16,
then multiples of 16 up to the engine's `max_num_seqs`); its attention masks each row by
context length, so a bucket's step has one set of shapes. Each bucket's step is
`torch.compile`d whole (`fullgraph`, static shapes), ahead of its first step
(`aot_compile`), into a graph of its own that is called without dynamo's guard check: this
module picks the graph by shape, and nothing else a guard would check (module structure,
dtypes, grad mode, the `LATHE_KERNELS` switches) changes in an engine's life. On CUDA each
graph is then captured as a CUDA graph and replayed (`lathe.serve.captured_step`). Elsewhere
inductor's C++ wrapper runs it (the wrapper, one function of thousands of lines, is built at
-O1 apart from the kernels at -O3: built with them at -O3 it had been 30% of the 88M model's
graph builds, and 57% of its builds with LoRA slots). Inductor fuses the
norms, RoPE, SwiGLU and residual adds around the GEMMs, so a step is a few dozen kernel
calls instead of ~150 ATen ops; with lathe's native CPU kernels loaded, a graph pass
(`lathe.kernels.decode_linear_pass`) also moves the linears of buckets up to 32 rows off
BLAS, one call for the linears that read the same input, and each projection's LoRA slots
are one call of `lathe.kernels.lora_bgmv`.

How much of the block table a step passes is a second bucket. Where a paged kernel runs
(Triton on CUDA, the native one on CPU) it is always the full width, one graph per batch
size: the kernel reads only each sequence's own blocks whatever the width. Otherwise
attention gathers every block the table holds, so the table is cut to the power of two of
blocks that holds the step's longest context: at batch 16 a full 512-position table cost
the README model more than the whole eager step.

Padding rows write their K/V to the slabs' scratch slot (past the last block, owned by no
sequence) and attend over it alone; their logits are dropped. A row is a token, not a
sequence: where every token of a step attends through its block table (on CPU, prefill
chunks and verified drafts over short contexts as well as decodes — see
`lathe.serve.model_runner`), the step runs through the same graphs, in calls of the largest
bucket when it has more tokens; other steps stay eager. A model with linear-attention
layers (Qwen3.5's Gated DeltaNet), whose states carry a sequence on a token at a time, runs
only its decodes here (not a prompt's first token, not drafts): each row's layer reads its
sequence's states by row (`RecurrentStates`; a padding row, the scratch row) and writes the
new ones back in place, inside the graph. Weights are read, not frozen into
the graph, so `LLMEngine.load_weights` (GRPO's refresh) needs no recompile.

`warm_up` builds every shape before it returns, so that no step under load pays a compile;
`late` counts the graphs built after it. `build_in_background` builds them on a thread of
their own instead, smallest batch size first, while the engine serves eagerly (a server
answers at once, not minutes later): a batch size's step runs compiled once every graph it
calls is built (`ready_for`), and eagerly until then — no step waits on a compile, and on
Linux the thread and its compilers run at a low CPU priority (niceness 10), so that the
steps are not slowed by them either. On CUDA the serving thread captures a built graph the
first time a step asks for it (a CUDA graph is replayed by the thread that records it; a
capture runs the compiled step three times, where a compile traces and builds it); a graph
that fails to capture leaves its batch size eager.

Off CUDA each compiled graph is saved under `cache_root()` (the user's own cache,
as inductor's; torch deserializes it) keyed by everything the graph was traced from — torch
and Python versions, the CPU's ISA, the sources of lathe's model, its kernels and this
module, the module tree with every tensor's shape and dtype, the KV slabs' layout, the
kernel policy, the compile options, the thread count, grad and autocast mode, the bucket —
so a second start loads each graph in milliseconds instead of compiling it; a file that
does not load is compiled again and overwritten.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

import lathe.kernels
import lathe.model
from lathe.kernels import AttentionVariant, paged_decode
from lathe.kernels.cpu_native import cpu_kernels_loaded, native_kernel
from lathe.kernels.dispatch import policy
from lathe.model.kv_cache import RecurrentStep
from lathe.model.transformer import Transformer
from lathe.serve.captured_step import CapturedStep
from lathe.serve.config import cache_root
from lathe.serve.paged_cache import KVSlabs
from lathe.serve.recurrent_states import RecurrentStates, StateSpans

log = logging.getLogger("lathe.serve")

BUILDING_SWITCH_SECONDS = 0.0002  # the GIL's switch interval while graphs build beside steps
BUILDING_NICENESS = 10  # the building thread's (Linux), of 0 (a process's default) to 19

# reports a warm-up's progress: graphs built so far, graphs in all
Progress = Callable[[int, int], None]


@functools.cache
def _source_digest() -> str:
    """A digest of the sources a decode graph is traced from: the model, its kernels (native
    sources included), this module's batch view, and the serving wrappers of its linears
    (quantized, LoRA slots) and embedding (half weights)."""
    here = Path(__file__).parent
    files = [Path(__file__), here / "quant.py", here / "adapters.py", here / "half_weights.py"]
    for package in (lathe.model, lathe.kernels):
        files += sorted(path for path in Path(package.__file__).parent.rglob("*")
                        if path.suffix in (".py", ".cpp", ".h") and path.is_file())
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes a compiled decode step exists for."""
    small = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


def width_buckets(max_blocks: int) -> list[int]:
    """The block-table widths a compiled decode step exists for off CUDA: powers of two."""
    return [1 << i for i in range(max_blocks.bit_length()) if 1 << i < max_blocks] + [max_blocks]


class StaticDecodeBatch:
    """One padded decode step as a `KVCache`: a token per row at `positions`, written to
    `slots`, attending over the first `lens` slots of its block table row; a
    linear-attention layer's token runs from, and writes back, the states of its row of
    `states` (`state_rows`). `spans`: the runner's view of the step's states (the
    snapshots it takes), held for after the step."""

    def __init__(self, slabs: KVSlabs, positions: Tensor, slots: Tensor, tables: Tensor,
                 lens: Tensor, states: RecurrentStates | None = None,
                 state_rows: Tensor | None = None, spans: StateSpans | None = None) -> None:
        self.slabs, self.positions, self.slots = slabs, positions, slots
        self.tables, self.lens = tables, lens
        self.states, self.state_rows, self.spans = states, state_rows, spans

    def graph_inputs(self, ids: Tensor) -> tuple[Tensor, ...]:
        """The arguments of `DecodeGraphs.run` for this step's token `ids`."""
        return (ids, self.positions, self.slots, self.tables, self.lens,
                *(() if self.state_rows is None else (self.state_rows,)))

    def recurrent(self, layer_idx: int, inputs: tuple[Tensor, ...],
                  step: RecurrentStep) -> Tensor:
        assert self.states is not None and self.state_rows is not None
        conv, state = self.states.conv[layer_idx], self.states.state[layer_idx]
        rows = self.state_rows
        out, (new_conv, new_state) = step(tuple(t[0, :, None] for t in inputs),
                                          (conv[rows], state[rows]))
        # padding rows all write the scratch row: whichever lands, no sequence reads it
        conv.index_copy_(0, rows, new_conv.to(conv.dtype))
        state.index_copy_(0, rows, new_state)
        return out[:, 0][None]

    def prepare(self, input_ids: Tensor, positions: Tensor | None) -> Tensor:
        return self.positions[None]

    # `variant` has no default: this view is made inside the compiled step, and dynamo
    # (torch 2.11, the CUDA path) cannot wrap a default of a method of an object made there
    # ("SourcelessBuilder ... AttentionVariant"), so every CUDA-graph step failed to trace
    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None,
               variant: AttentionVariant) -> Tensor:
        k_slab, v_slab = self.slabs.k[layer_idx], self.slabs.v[layer_idx]
        if k is not None:  # None: a layer sharing layer_idx's, which stored them
            k_slab.index_copy_(0, self.slots, k[0].transpose(0, 1).to(k_slab.dtype))
            v_slab.index_copy_(0, self.slots, v[0].transpose(0, 1).to(v_slab.dtype))
        queries = q[0].transpose(0, 1).to(k_slab.dtype)  # (B, H, D)
        out = paged_decode(queries, k_slab, v_slab, self.tables, self.lens,
                           self.slabs.block_size, variant)
        return out.transpose(0, 1)[None].to(q.dtype)


class DecodeGraphs:
    def __init__(self, model: Transformer, slabs: KVSlabs, max_num_seqs: int,
                 max_blocks: int, states: RecurrentStates | None = None) -> None:
        """`states`: a model with linear-attention layers' (its graphs read and write them
        in place: states that grow into new tensors are no longer theirs)."""
        self.model, self.slabs, self.states = model, slabs, states
        self._scratch = states.scratch if states is not None else 0
        self.buckets = batch_buckets(max_num_seqs)
        self.steps = 0  # decode steps run compiled
        self.built: Counter[str] = Counter()  # graphs by origin: "compiled", "cached"
        self.late = 0  # graphs built after `warm_up`: each a compile under load
        self.warm = False
        self.ready: set[int] = set()  # batch buckets whose every width's graph is built
        # built in the background: until all are, only `ready` buckets run compiled (else
        # a bucket's first step compiles it, as without a warm-up)
        self.background = False
        self.stopping = False  # the engine is closing: a background build ends quietly
        self.failed = False  # a background build stopped on an error: nothing pending since
        self.cuda = cuda = slabs.k[0].device.type == "cuda"
        paged_kernel = cuda or native_kernel("paged_decode", slabs.k[0])
        self.widths = [max_blocks] if paged_kernel else width_buckets(max_blocks)
        self._graphs: dict[tuple[int, int], Callable[..., Tensor]] = {}
        self._compiler: Callable | None = None  # made by the first build (`_make_compiler`)
        self._options: list[str] = []
        # on CUDA: each shape's graph as recorded by the serving thread, in one memory pool
        self._captured: dict[tuple[int, int], CapturedStep] = {}
        self._pool: tuple[int, int] | None = None

    def stats(self) -> dict[str, float]:
        """Graphs compiled, loaded from the cache, built under load, and still to build;
        whether a background build failed."""
        return {"decode_graphs_compiled": self.built["compiled"],
                "decode_graphs_cached": self.built["cached"],
                "decode_graphs_late": self.late,
                "decode_graphs_pending": 0 if self.failed
                else len(self.shapes) - sum(self.built.values()),
                "decode_graphs_failed": int(self.failed)}

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every (batch bucket, table width) a decode step may run at."""
        return [(size, width) for size in self.buckets for width in self.widths]

    @torch.no_grad()  # as the engine's steps run: a graph traced with grad is slow
    def warm_up(self, progress: Progress | None = None) -> None:
        """Build the graph of every shape now (compile it, or load it from the cache), each
        run once on padding rows, which touch only the scratch slot."""
        shapes = self.shapes
        for done, (size, width) in enumerate(shapes):
            self.run(*self._padding(size, width))
            if width == self.widths[-1]:
                self.ready.add(size)
            if progress is not None:
                progress(done + 1, len(shapes))
        self.warm = True

    def build_in_background(self, progress: Progress | None = None,
                            failed: Callable[[Exception], None] | None = None) -> None:
        """Build every shape's graph on a thread of its own (compiled, or loaded from the
        cache, never run there) and return at once; each batch bucket joins `ready` when its
        widths are all built. A failure stops the building (`failed` is told): the buckets
        ready by then stay compiled, the rest run eagerly."""
        self.background = True
        threading.Thread(target=self._build_all, args=(progress, failed),
                         name="lathe-decode-graphs", daemon=True).start()

    @torch.no_grad()
    def _build_all(self, progress: Progress | None,
                   failed: Callable[[Exception], None] | None) -> None:
        # tracing holds the GIL for long stretches, and the serving thread gives it up
        # around every op: at the default 5 ms switch interval it waited that long to get
        # it back each time, and an eager step took seconds
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, BUILDING_SWITCH_SECONDS))
        if sys.platform == "linux":  # where a thread has a niceness of its own
            # and so do the compilers it starts: the serving threads' steps take the cores
            # first (88M model, its first 16 tokens while graphs build: 2.7 s at the same
            # niceness, 0.63 s at 10, 0.56 s at 19, 0.31 s with nothing building); above
            # 10, other processes' work would hold the build off for longer
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread,  # never below the process's own
                           max(os.getpriority(os.PRIO_PROCESS, thread), BUILDING_NICENESS))
        try:
            self._build_shapes(progress, failed)
        finally:
            sys.setswitchinterval(interval)

    def _build_shapes(self, progress: Progress | None,
                      failed: Callable[[Exception], None] | None) -> None:
        shapes = self.shapes
        try:
            for done, (size, width) in enumerate(shapes):
                if self.stopping:
                    return
                shape = (size, width)
                if shape not in self._graphs:
                    self._graphs[shape] = self._build(shape, self._padding(size, width))
                if width == self.widths[-1]:
                    self.ready.add(size)
                if progress is not None:
                    progress(done + 1, len(shapes))
        except Exception as error:  # whatever the compiler stack raises
            if not self.stopping:  # else torn down under it
                self.failed = True
                if failed is not None:
                    failed(error)
            return
        self.warm = True

    def ready_for(self, rows: int) -> bool:
        """Whether a step of `rows` tokens calls only built graphs (past the largest bucket
        it runs as calls of that bucket, and one of the rest); on CUDA each is captured the
        first time it is asked for, on this (the serving) thread."""
        if not self.background or (self.warm and not self.cuda):
            return True
        largest = self.buckets[-1]
        if rows <= largest:
            wanted = {self.bucket(rows)}
        else:
            rest = rows % largest
            wanted = {largest, self.bucket(rest)} if rest else {largest}
        if not wanted <= self.ready:
            return False
        return not self.cuda or all(self._captures(size) for size in wanted)

    def _captures(self, size: int) -> bool:
        """Whether the built graph of batch bucket `size` is captured, capturing it now if
        not; one that fails to is dropped from `ready`, its steps eager from then on."""
        shape = (size, self.widths[-1])
        if shape in self._captured:
            return True
        try:
            self._capture(shape, self._graphs[shape])
        except Exception as error:  # whatever recording the compiled step raises
            log.warning("capturing the decode step of shape %s as a CUDA graph failed (%s: "
                        "%s); its steps run eagerly", shape, type(error).__name__, error)
            self.ready.discard(size)
            return False
        return True

    def _capture(self, shape: tuple[int, int], graph: Callable[..., Tensor]) -> CapturedStep:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.no_grad():
            captured = CapturedStep(functools.partial(graph, self), self._padding(*shape),
                                    self._pool)
        self._captured[shape] = captured
        return captured

    def _padding(self, size: int, width: int) -> tuple[Tensor, ...]:
        """A step of `size` padding rows with a `width`-block table (no two arguments one
        tensor: the graph traced from it would read one for both)."""
        scratch = self.slabs.scratch_slot
        device = self.slabs.k[0].device
        return (torch.zeros(size, dtype=torch.long, device=device),
                torch.zeros(size, dtype=torch.long, device=device),
                torch.full((size,), scratch, device=device),
                torch.full((size, width), scratch // self.slabs.block_size, device=device),
                torch.ones(size, dtype=torch.long, device=device),
                *(() if self.states is None
                  else (torch.full((size,), self.states.scratch, device=device),)))

    def bucket(self, batch: int) -> int | None:
        """The padded size of a `batch`-row decode step, None past the largest bucket."""
        at = bisect.bisect_left(self.buckets, batch)
        return self.buckets[at] if at < len(self.buckets) else None

    def width(self, blocks: int) -> int:
        """The table width a step whose longest context spans `blocks` blocks runs at."""
        return self.widths[bisect.bisect_left(self.widths, blocks)]

    def _forward(self, ids: Tensor, positions: Tensor, slots: Tensor, tables: Tensor,
                 lens: Tensor, state_rows: Tensor | None = None) -> Tensor:
        view = StaticDecodeBatch(self.slabs, positions, slots, tables, lens, self.states,
                                 state_rows)
        return self.model(ids[None], kv_cache=view, head=False).hidden[0]

    @property
    def states_current(self) -> bool:
        """Whether the linear-attention states are still the tensors the graphs were built
        over (not grown since; true without such layers)."""
        return self.states is None or self.states.scratch == self._scratch

    def run(self, ids: Tensor, positions: Tensor, slots: Tensor, tables: Tensor,
            lens: Tensor, state_rows: Tensor | None = None) -> Tensor:
        """The final norm's output (B, dim) of a B-row step (all arguments (B,) but
        `tables`, (B, a `width` bucket)), computed at the bucket's padded size; the LM head
        is the caller's (`Transformer.compute_logits`), on the rows it keeps. A model with
        linear-attention layers gives each row's `state_rows`."""
        batch = ids.shape[0]
        size = self.bucket(batch)
        if size is None:
            raise ValueError(f"a decode step of {batch} rows exceeds the largest compiled "
                             f"bucket ({self.buckets[-1]}); run it eager")
        pad = size - batch
        if pad:
            scratch = self.slabs.scratch_slot
            ids = torch.cat([ids, ids.new_zeros(pad)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
            slots = torch.cat([slots, slots.new_full((pad,), scratch)])
            # a padding row's table points at the scratch slot's block: its one visible slot
            tables = torch.cat([tables, tables.new_full((pad, tables.shape[1]),
                                                        scratch // self.slabs.block_size)])
            lens = torch.cat([lens, lens.new_ones(pad)])
            if state_rows is not None:
                state_rows = torch.cat([state_rows, state_rows.new_full((pad,),
                                                                        self._scratch)])
        self.steps += 1
        inputs = (ids, positions, slots, tables, lens,
                  *(() if state_rows is None else (state_rows,)))
        shape = (size, tables.shape[1])
        graph = self._graphs.get(shape)
        if graph is None:
            graph = self._graphs[shape] = self._build(shape, inputs)
        if self.cuda:
            captured = self._captured.get(shape) or self._capture(shape, graph)
            return captured(*inputs)[:batch]
        return graph(self, *inputs)[:batch]

    def _make_compiler(self) -> Callable:
        """The compiled step every graph is built from, made by the first build, on the
        thread that builds: importing dynamo and inductor takes seconds, which an engine that
        serves eagerly meanwhile (`build_in_background`) need not wait for to start."""
        if self._compiler is not None:
            return self._compiler
        # vLLM's way: the check of ~700 guards on the model's modules and tensors, and the
        # Python wrapper's ~100 tensor views, had been half of the README model's batch-1
        # step on CPU; size_asserts re-check every extern op's output layout on each call
        # (5-20% of that step; the equality tests against eager cover the layouts)
        options = {"size_asserts": False,
                   "guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
        if not self.cuda:  # a CUDA graph's replay runs no wrapper
            options["cpp_wrapper"] = True
            if hasattr(torch._inductor.config, "cpp_wrapper_build_separate"):
                # the wrapper at -O1, the kernels at -O3 (see the module docstring)
                options["cpp_wrapper_build_separate"] = True
        if native_kernel("decode_linear", self.slabs.k[0]):
            from lathe.kernels.decode_linear_pass import DecodeLinearPass
            options["post_grad_custom_post_pass"] = DecodeLinearPass()
        # torch 2.11 attaches `aot_compile` to the compiled function only under this switch
        # (on by default from 2.13); without it the engine served eagerly. A torch older than
        # the switch has no aot_compile: warm-up then falls back to eager
        aot = {"enable_aot_compile": True} if hasattr(torch._dynamo.config,
                                                      "enable_aot_compile") else {}
        with torch._dynamo.config.patch(**aot):
            self._compiler = torch.compile(self._forward, fullgraph=True, dynamic=False,
                                           options=options)
        self._options = sorted(options)
        return self._compiler

    def _build(self, shape: tuple[int, int], inputs: tuple[Tensor, ...]) -> Callable[..., Tensor]:
        """The graph of one shape, compiled ahead of time, or off CUDA loaded from the cache
        (the cache's key describes a CPU's graph)."""
        if self.warm:
            self.late += 1
            log.warning("decode step of shape %s was not warmed up: compiling it under load",
                        shape)
        compiler = self._make_compiler()  # before the key, which holds its options
        if self.cuda:
            return self._compile(compiler, inputs)
        key = hashlib.sha256((self._describe() + repr(shape)).encode()).hexdigest()
        path = cache_root() / "decode-graphs" / f"{key[:32]}.bin"
        graph = self._load(path)
        if graph is not None:
            self.built["cached"] += 1
            return graph
        graph = self._compile(compiler, inputs)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            graph.save_compiled_function(str(path))  # written to a temporary, then renamed
        except (OSError, RuntimeError) as error:
            log.warning("cannot cache the decode graph at %s: %s", path, error)
        return graph

    def _compile(self, compiler: Callable, inputs: tuple[Tensor, ...]) -> Callable[..., Tensor]:
        graph = compiler.aot_compile((inputs, {}))
        graph.disable_guard_check()
        self.built["compiled"] += 1
        return graph

    @staticmethod
    def _load(path: Path) -> Callable[..., Tensor] | None:
        if not path.is_file():
            return None
        try:
            with path.open("rb") as f:
                graph = torch.compiler.load_compiled_function(f)
        except Exception as error:  # whatever a stale or damaged artifact raises
            log.warning("cached decode graph %s does not load (%s: %s); compiling it again",
                        path, type(error).__name__, error)
            return None
        graph.disable_guard_check()
        return graph

    def _describe(self) -> str:
        """What a graph is traced from besides its shape: with guards skipped, a loaded graph
        is trusted to match on all of it."""
        tensors = [(name, tuple(t.shape), t.stride(), str(t.dtype), str(t.device))
                   for name, t in (*self.model.named_parameters(),
                                   *self.model.named_buffers())]
        slab, kernels = self.slabs.k[0], policy()
        states = None if self.states is None else [
            (tuple(t.shape), str(t.dtype)) for table in (self.states.conv, self.states.state)
            for t in table.values()]
        return repr((torch.__version__, sys.version, platform.machine(),
                     torch.backends.cpu.get_cpu_capability(), _source_digest(), repr(self.model),
                     tensors, vars(self.model.config),
                     [tuple(slab.shape) for slab in self.slabs.k], states,
                     str(slab.dtype), self.slabs.block_size, self.slabs.scratch_slot,
                     # sorted: a frozenset's order changes from one process to the next
                     sorted((device, sorted(on)) for device, on in kernels.on.items()),
                     kernels.force, cpu_kernels_loaded(), self._options,
                     # inductor writes the thread count into the graph's parallel loops
                     torch.get_num_threads(), torch.get_default_dtype(),
                     torch.is_grad_enabled(),
                     torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
