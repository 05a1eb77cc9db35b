"""The serving engine: continuous batching of many requests over one paged KV cache,
running the shared `lathe.model.Transformer`.

`LLMEngine.step()` is the whole hot loop, in four calls: the `Scheduler` picks what runs (and
how many decode passes: multi-step decoding); the `StepExecutor` (`lathe.serve.executor`)
runs it — the `ModelRunner`'s forward pass, the `Sampler`'s draws with structured outputs'
grammar masks, the `Speculator`'s drafts and checks; the scheduler counts what the step
computed and offers newly full blocks to the prefix cache; and the `OutputProcessor`
(`lathe.serve.outputs`: detokenizing, stop conditions) turns the tokens into what each
sequence gained, `SequenceDelta`s. Requests are checked once, at the door
(`lathe.serve.request_checks`); `lathe.serve.offline` is the offline API on top, and
`lathe.serve.async_engine` streams the same deltas from an engine core in its own process.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor

from lathe.core.checkpoint_files import read_eos_ids
from lathe.core.errors import ConfigError
from lathe.kernels import configure_kernels
from lathe.model.checkpoint import read_weights
from lathe.model.config import ModelConfig
from lathe.model.transformer import Transformer
from lathe.serve.adapters import AdapterSlots
from lathe.serve.block_manager import BlockManager
from lathe.serve.config import EngineConfig, QuantMode
from lathe.serve.decode_graph import Progress, batch_buckets
from lathe.serve.executor import StepExecutor
from lathe.serve.half_weights import activation_dtype
from lathe.serve.model_runner import ModelRunner
from lathe.serve.offline import generate
from lathe.serve.outputs import Completion, OutputProcessor, Pick, SequenceDelta
from lathe.serve.paged_cache import KVSlabs, blocks_in_budget
from lathe.serve.quant import load_serving_model, serving_tokenizer, weight_bytes
from lathe.serve.recurrent_states import StateSnapshots
from lathe.serve.request_checks import AdapterError, RequestError, RequestLimits
from lathe.serve.sampler import Sampler
from lathe.serve.sampling import seeded_generator
from lathe.serve.sampling_defaults import SamplingDefaults, read_sampling_defaults
from lathe.serve.sampling_params import SamplingParams
from lathe.serve.scheduler import Scheduler, StepCost
from lathe.serve.sequence import Sequence, Status, request_sequences
from lathe.serve.speculative import Speculator, check_draft, load_draft
from lathe.serve.structured import compile_structured


def serving_length(config: EngineConfig, model: ModelConfig) -> int:
    """The longest sequence an engine serves: `max_model_len`, at most the model's own."""
    if config.max_model_len is None:
        return model.max_seq_len
    if config.max_model_len > model.max_seq_len:
        raise ConfigError(f"max_model_len={config.max_model_len} exceeds this model's "
                          f"max_position_embeddings ({model.max_seq_len}): positions past it "
                          f"are not the model's; set max_model_len <= {model.max_seq_len}")
    return config.max_model_len


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None = None,
                 config: EngineConfig | None = None,
                 eos_token_ids: Iterable[int] = (), kv_dtype: torch.dtype | None = None,
                 draft_model: Transformer | None = None) -> None:
        """`kv_dtype`: the KV cache's dtype, by default the activations'; a training stage
        passes its autocast dtype (see `lathe.pretrain.runtime.precision`). `draft_model`: the
        proposer of `config.speculative` with method "draft"."""
        model.config.require_language_model("the serve engine")
        configure_kernels()  # which kernels its steps take, chosen once, here
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.eos_token_ids = set(eos_token_ids)
        # a checkpoint's recommended sampling (`lathe.serve.sampling_defaults`), from_checkpoint's
        self.sampling_defaults: SamplingDefaults = {}
        self.weight_version = 0  # weight loads so far (`load_weights`, `update_weights`)
        self.device = model.model.embed_tokens.weight.device
        self.max_model_len = serving_length(self.config, model.config)
        dtype = kv_dtype or activation_dtype(model)
        speculative = self.config.speculative
        recurrent = model.config.linear_layer_count > 0
        check_draft(model, draft_model, speculative)
        num_blocks = self.config.num_blocks or blocks_in_budget(
            self.config, [m.config for m in (model, draft_model) if m is not None], self.device,
            dtype, self.max_model_len)
        block_size = self.config.block_size
        self.block_manager = BlockManager(num_blocks, block_size)
        self.slabs = KVSlabs(model.config, num_blocks, block_size, self.device, dtype)
        lookahead = speculative.num_speculative_tokens if speculative else 0
        self.adapters = AdapterSlots(model, self.config.max_loras, self.config.max_lora_rank,
                                     batch_buckets(self.config.max_num_seqs)[-1],
                                     self.config.max_loaded_loras) \
            if self.config.max_loras else None
        # the callback is the adapters', not a method of the engine: no reference cycle, so
        # a dropped engine frees its KV cache at once (on a GPU, before the next one is sized)
        # a cached prefix has keys and values but no linear-attention state at its end: such
        # a model's prefix ends where its states were kept
        caching = self.config.prefix_caching
        self.snapshots = StateSnapshots(self.config.recurrent_snapshots) \
            if caching and recurrent and self.config.recurrent_snapshots else None
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, lookahead,
                                   None if self.adapters is None else self.adapters.admit,
                                   prefix_caching=caching and (
                                       not recurrent or self.snapshots is not None),
                                   prefix_ends=None if self.snapshots is None
                                   else self.snapshots.__contains__)
        self.step_cost = StepCost(self.config.max_decode_stall, block_size)
        # a compiled step reads each row's adapter slot from one tensor the largest bucket
        # long, so with adapters a step runs compiled only within one bucket
        self.runner = ModelRunner(model, self.slabs, self.device, self.max_model_len,
                                  self.config.max_num_seqs,
                                  compile_decode=self.config.compile_decode,
                                  retain_memory=self.config.retain_freed_memory,
                                  max_static_rows=None if self.adapters is None
                                  else len(self.adapters.row_slots),
                                  snapshots=self.snapshots,
                                  block_hash=self.block_manager.hash_of,
                                  snapshot_stride=self.config.recurrent_snapshot_stride)
        draft_slabs = None if draft_model is None else KVSlabs(
            draft_model.config, num_blocks, block_size, self.device, dtype)
        self.speculator = None if speculative is None else Speculator(
            speculative, self.runner, draft_model, draft_slabs, self.max_model_len)
        # what the server holds in memory, for /metrics: the weights as served (quantized
        # ones at their packed size) and the KV slabs, a draft model's included
        self.memory = {"weight_bytes": weight_bytes(model) + (
                           0 if draft_model is None else weight_bytes(draft_model)),
                       "kv_cache_bytes": self.slabs.nbytes + (
                           0 if draft_slabs is None else draft_slabs.nbytes) + (
                           0 if self.runner.states is None else self.runner.states.nbytes)}
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        self.sampler = Sampler(tokenizer, model.config.vocab_size, self.eos_token_ids,
                               self.device)
        self.executor = StepExecutor(self.runner, self.sampler, self.speculator, self.adapters,
                                     self.device)
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()
        self.prompt_tokens_total = 0

    @classmethod
    def from_checkpoint(cls, path: str | Path, config: EngineConfig | None = None,
                        quantize: QuantMode | None = None, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> LLMEngine:
        """An engine on a checkpoint folder: its weights (optionally quantized at load), its
        tokenizer when it has one, and the EOS ids of its generation_config.json."""
        path = Path(path)
        model = load_serving_model(path, quantize=quantize, dtype=dtype, device=device)
        vocab = model.config.vocab_size
        tokenizer = serving_tokenizer(path, vocab)
        draft = load_draft(path, config.speculative if config is not None else None, tokenizer,
                           quantize, dtype, device)
        engine = cls(model, tokenizer, config, read_eos_ids(path, vocab), draft_model=draft)
        engine.sampling_defaults = read_sampling_defaults(path)
        return engine

    def default_sampling_params(self) -> SamplingParams:
        """The sampling `generate` uses when given none: the checkpoint's recommended
        (its generation_config.json's), else `SamplingParams`' defaults — vLLM's
        `LLM.get_default_sampling_params`."""
        return SamplingParams(**self.sampling_defaults)

    # requests ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`text` as token ids; `add_special_tokens`: with what the tokenizer's post-processor
        adds (a BOS), as a completions prompt takes by default."""
        if self.tokenizer is None:
            raise RequestError("this checkpoint has no tokenizer.json: send token ids, not text")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def limits(self) -> RequestLimits:
        """What a request must fit to be served here (also checked by a server's front end)."""
        return RequestLimits(self.model.config.vocab_size, self.max_model_len,
                             self.block_manager.block_size, len(self.block_manager.blocks),
                             self.tokenizer is not None)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise `RequestError` for a request this engine could never complete."""
        self.limits.check(prompt_ids, params)
        if params.structured is not None:
            compile_structured(self.sampler.constraints.compiler, params.structured)

    def add_adapter(self, name: str, path: str | Path) -> list[str]:
        """Load a LoRA adapter folder, to be named by requests; the names loaded after it
        (one idle adapter may have been unloaded to make room: max_loaded_loras)."""
        self._adapter_slots().add(name, path)
        return self.adapters.names

    def put_adapter(self, name: str, weights: dict[str, tuple[Tensor, Tensor]],
                    scale: float) -> None:
        """Hold in-memory LoRA weights (module name -> (A, B)) under `name`, replacing an
        idle adapter of that name (a training policy's adapters, each step)."""
        self._adapter_slots().put(name, weights, scale)

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter; requests already running on it finish on it."""
        self._adapter_slots().remove(name)

    def _adapter_slots(self) -> AdapterSlots:
        if self.adapters is None:
            raise AdapterError("this engine serves no adapters: start it with max_loras > 0 "
                               "(lathe serve --max-loras N)")
        return self.adapters

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, adapter: str | None = None,
                    checked: bool = False) -> str:
        """Queue a request (n sequences), on the LoRA adapter named `adapter` if given;
        returns its id. `checked`: a server's front end has checked it against `limits`
        and compiled its structured output already (`AsyncEngine.submit_all`)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not checked:
            self.validate(prompt_ids, params)
        root = None if adapter is None else self._adapter_slots().root(adapter)
        seqs = request_sequences(request_id, prompt_ids, params,
                                 functools.partial(seeded_generator, params, self.device),
                                 self.eos_token_ids, self.weight_version)
        for seq in seqs:  # built all before scheduling any, so a failure leaves no trace
            if adapter is not None:
                seq.adapter, seq.cache_root = adapter, root
            self.outputs.add(seq)
            if params.structured is not None:
                self.sampler.constraints.start(seq, params.structured)
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        self.prompt_tokens_total += len(prompt_ids) * params.n
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks (a no-op once it has finished)."""
        for seq in self.requests.pop(request_id, []):
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "abort")
            self.outputs.remove(seq)
            self.executor.release(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.executor.release(seq)
        if all(s.status is Status.FINISHED for s in self.requests.get(seq.request_id, [])):
            self.requests.pop(seq.request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # the step ---------------------------------------------------------------------------

    # no_grad, not inference_mode: a training stage's engine may run an FP8 (torchao) policy
    # under autocast, which fails in inference mode
    @torch.no_grad()
    def step(self) -> list[SequenceDelta]:
        batch = self.scheduler.schedule(self.step_cost.prefill_cap())
        if not batch.items:
            return []
        steps = self.scheduler.decode_run(batch, self.config.decode_steps)
        start = time.perf_counter()
        picks = self.executor.execute(batch, steps)
        self.step_cost.observe(batch, (time.perf_counter() - start) / steps)
        self.scheduler.update_from_output(batch, picks, None if self.speculator is None
                                          else self.speculator.cacheable)
        if self.snapshots is not None:
            self.runner.keep_snapshots()
        return [self._emit(seq, picks[seq]) for seq, _ in batch.items if seq in picks]

    def _emit(self, seq: Sequence, picks: list[Pick]) -> SequenceDelta:
        """The step's tokens of `seq` as a delta; a sequence they finish is let go, and one
        whose constraint broke ends with finish_reason "error" and the reason."""
        error = self.sampler.broken.pop(seq, None)
        if error is not None:
            delta = self.outputs.fail(seq, error)  # before `_finish` frees the blocks it counts
            self._finish(seq, "error")
            return delta
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        delta = self.outputs.append(seq, picks)
        if delta.finish_reason is not None:
            self._finish(seq, delta.finish_reason)
        return delta

    # offline API and weights ------------------------------------------------------------

    def generate(self, prompts: list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False, adapter: str | None = None) -> list[Completion]:
        """Complete every prompt (`lathe.serve.offline.generate`)."""
        return generate(self, prompts, params, progress, adapter)

    def warm_up(self, progress: Progress | None = None) -> None:
        """Build every compiled decode step (`ModelRunner.warm_up`): now, or with
        `compile_in_background` on a thread while the engine serves."""
        self.runner.warm_up(self.config.compile_in_background, progress)

    @property
    def builds_in_background(self) -> bool:
        """Whether `warm_up` returns at once, its compiled steps built on a thread of their
        own while the engine serves eagerly (`compile_in_background`)."""
        return self.config.compile_in_background and self.runner.graphs is not None

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Swap in new weights (e.g. the policy after a GRPO update) between requests; the
        prefix cache is emptied since its KV came from the old weights."""
        if self.has_unfinished():
            raise RuntimeError("load_weights needs an idle engine; wait for or abort the "
                               f"{self.num_running + self.num_waiting} unfinished sequences")
        self.runner.load_weights(state_dict)
        self.block_manager.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.clear()
        self.weight_version += 1

    def update_weights(self, path: str) -> int:
        """Load new weights of the same model from a folder of safetensors shards (a
        checkpoint's, or a trainer's push: `lathe.model.checkpoint.write_weights`); returns
        the count of updates so far, the weights' version."""
        self.load_weights(read_weights(path, self.model.config, self.device))
        return self.weight_version

    def stats(self) -> dict[str, float]:
        """Every counter of the engine: requests, KV and prefix cache, tokens, memory, and
        the compiled decode steps' and speculation's when they are on."""
        manager = self.block_manager
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_cache_usage": manager.usage,
            "prefix_cache_queries": manager.prefix_queries,
            "prefix_cache_hits": manager.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.prompt_tokens_total,
            "generation_tokens": self.outputs.generation_tokens_total,
            **self.memory,
            **({"recurrent_snapshots": len(self.snapshots)} if self.snapshots is not None
               else {}),
            **(self.runner.graphs.stats() if self.runner.graphs is not None else {}),
            **(self.speculator.stats() if self.speculator is not None else {}),
        }
