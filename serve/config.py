"""The serving configs — `EngineConfig` (and the `SpeculativeConfig` it nests) and
`ServerConfig`: everything `lathe serve` is told, the server's own settings, its connection
limits and its engine's — checked here once, whether they come from flags (generated from
these fields by `lathe.core.config.add_config_flags`), a YAML file or code. No torch here:
a server's front end reads them too."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lathe.core.checkpoint_files import GENERATION_CONFIG_FILE
from lathe.core.config import cli
from lathe.core.errors import ConfigError
from lathe.serve.connections import ConnectionLimits
from lathe.serve.reasoning import REASONING_PARSERS
from lathe.serve.tool_calls import PARSERS

DEFAULT_KV_MB = 2048  # the largest KV budget off-GPU when none is given (vLLM's CPU: 4 GiB)
QuantMode = Literal["int8", "int4", "fp8"]
WeightDtype = Literal["auto", "float32", "bfloat16", "float16"]
LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


METHODS = ("draft", "ngram")


@dataclass
class SpeculativeConfig:
    method: Literal["draft", "ngram"] = field(default="draft", metadata=cli(
        "draft: --draft's model proposes; ngram: prompt lookup (default: draft when --draft "
        "is given)", flag="--speculative", show_default=False))
    num_speculative_tokens: int = field(default=4, metadata=cli(
        "draft tokens verified per step"))
    # the draft checkpoint (method draft; a caller may hand `LLMEngine` a model instead)
    draft: Path | None = field(default=None, metadata=cli(
        "draft model checkpoint sharing this model's tokenizer (e.g. the student of "
        "`lathe distill`)", metavar="CKPT"))
    prompt_lookup_min: int = field(default=1, metadata=cli(
        "ngram: the shortest suffix looked up"))
    prompt_lookup_max: int = field(default=4, metadata=cli(
        "ngram: the longest suffix looked up (tried first)"))

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative method={self.method!r} is not one of {METHODS}")
        if self.method == "ngram" and self.draft is not None:
            raise ConfigError("draft=... is for method=draft; prompt lookup (ngram) needs no "
                              "draft model — drop one of them")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens={self.num_speculative_tokens} must be "
                              "in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min={self.prompt_lookup_min} and "
                              f"prompt_lookup_max={self.prompt_lookup_max} need "
                              "1 <= min <= max")


@dataclass
class EngineConfig:
    block_size: int = field(default=16, metadata=cli("tokens per KV cache block"))
    num_blocks: int | None = field(default=None, metadata=cli(
        "KV cache blocks (default: as many as the memory budget holds)"))
    # KV budget, on any device (vLLM's kv_cache_memory_bytes). Unset: on CUDA the share of
    # the card gpu_memory_utilization leaves; off-GPU what max_num_seqs sequences of
    # max_model_len take, at most DEFAULT_KV_MB (a budget too small for the batch
    # preempts under load: 256 MiB held 22 of 64 concurrent 160-token requests on a 88M model)
    kv_cache_memory_mb: float | None = field(default=None, metadata=cli(
        "KV budget, on a GPU too (default: on a GPU, the share --gpu-memory-utilization "
        "leaves; off it, what --max-num-seqs sequences of --max-model-len take, at most "
        f"{DEFAULT_KV_MB} MiB)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=cli(
        "on a GPU without --kv-cache-memory-mb: the fraction of its memory to fill"))
    # vLLM's: a 128k-position checkpoint served where requests stay short, its default
    # completions' length and (off a GPU) its KV budget with them
    max_model_len: int | None = field(default=None, metadata=cli(
        "the longest sequence, prompt and output together, a request may reach (default: "
        "the model's max_position_embeddings; no more than that)"))
    max_num_seqs: int = field(default=64, metadata=cli("sequences running at once"))
    max_num_batched_tokens: int = field(default=512, metadata=cli("tokens one step runs"))
    # (Sarathi-Serve) the estimate is `lathe.serve.scheduler.StepCost`'s, a block's worth of
    # prefill at least, so a burst of new prompts stalls the running streams by that much,
    # not by a whole token budget of prefill
    max_decode_stall: float = field(default=0.0, metadata=cli(
        "with streams decoding, a step lasts at most this many decode-only steps: new "
        "prompts' prefill is cut into chunks that fit, by the engine's running estimate of "
        "each step's cost. Smoother streams, later first tokens: on an 88M model at 16 "
        "concurrent requests, 4 cut the inter-token p99 from 312 to 144 ms but doubled the "
        "time-to-first-token p99 and lost 27% of the throughput. 0: off, prefills take the "
        "whole --max-num-batched-tokens"))
    speculative: SpeculativeConfig | None = None
    # through `lathe.serve.decode_graph` (on CPU short prefills and drafts too: steps whose
    # every token attends through its block table); `LLMEngine.warm_up` builds them all, or
    # each shape's first step pays its compile. Off in the class's default, where an engine
    # may live for one evaluation (a training stage's); a server's turns it on
    compile_decode: bool = field(default=False, metadata=cli(
        "run every step eagerly (by default decode steps, and on CPU short prefills, run "
        "compiled: one graph per batch-size bucket, CUDA graphs on CUDA, cached across "
        "starts under $LATHE_CACHE_DIR, default ~/.cache/lathe)", negate="--enforce-eager"))
    compile_in_background: bool = field(default=False, metadata=cli(
        "build every compiled step before /health turns ok (no eager step after the start: "
        "for benchmarks). By default they are built on a thread of their own while the "
        "server already answers eagerly, each batch size switching to its graphs once "
        "built", negate="--compile-before-ready"))
    # process-wide and for good (`lathe.serve.host_memory`). A training stage that generates
    # between its steps turns it off: kept, a step's freed activations stay resident (a
    # 57M-parameter LoRA SFT on CPU peaked at 1.24 GiB instead of 0.82)
    retain_freed_memory: bool = field(default=True, metadata=cli(
        "off CUDA, return freed memory to the system after each step (by default glibc "
        "keeps it for the next: faster steps, a resident set that stays at its peak)"))
    # (vLLM's num_scheduler_steps) what CPython spends per step is paid once per run of them;
    # tokens are the same as one step at a time
    decode_steps: int = field(default=1, metadata=cli(
        "multi-step decoding: forward passes a decode-only step runs before scheduling and "
        "streaming again (output streams in runs of this many tokens, and a request "
        "arriving meanwhile waits for the run's end; not with speculative decoding)"))
    # (vLLM's --enable-prefix-caching) `lathe.serve.block_manager`
    prefix_caching: bool = field(default=True, metadata=cli(
        "compute every prompt from its first token (by default a prompt starts from the KV "
        "of a prefix computed before; for a model with linear-attention layers, where their "
        "states were kept: --recurrent-snapshots)",
        negate="--no-enable-prefix-caching"))
    # a model with linear-attention layers (Qwen3.5's, Qwen3-Next's): their states at the end
    # of cached prefixes (`lathe.serve.recurrent_states`), one sequence's states each (a
    # Qwen3.5-9B's: ~50 MiB); on a GPU they come out of the KV budget
    recurrent_snapshots: int = field(default=32, metadata=cli(
        "a model with linear-attention layers: prefixes whose states are kept for prefix "
        "caching, each at the last block boundary of a prefill chunk (0: no prefix caching "
        "for such a model)"))
    recurrent_snapshot_stride: int = field(default=1024, metadata=cli(
        "a model with linear-attention layers: a long prefill chunk also keeps its states at "
        "every multiple of this many tokens, so a long shared prefix (a system prompt, "
        "tools) resumes near its end for prompts that differ after it; rounded down to a "
        "multiple of --block-size (0: at each chunk's last block boundary alone)"))
    # LoRA adapters served over the base in the same batch (`lathe.serve.adapters`)
    max_loras: int = field(default=0, metadata=cli(
        "adapter slots held at once, loaded at start or through /v1/load_lora_adapter "
        "(0: a server takes one for each --lora)"))
    max_lora_rank: int = field(default=16, metadata=cli(
        "the highest adapter rank a slot takes"))
    max_loaded_loras: int | None = field(default=None, metadata=cli(
        "adapters held in host memory; loading one more unloads the least recently used idle "
        "one (default: no limit)"))

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        for name, zero in (
                ("recurrent_snapshots", "no prefix caching for a model with linear-attention "
                 "layers"),
                ("recurrent_snapshot_stride", "at each chunk's last block boundary alone")):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0 (0: {zero})")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 1 (or None: "
                              "the model's max_position_embeddings)")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks={self.num_blocks} must be >= 1 (or None: sized "
                              "from the memory budget)")
        if self.kv_cache_memory_mb is not None and not self.kv_cache_memory_mb > 0:
            raise ConfigError(f"kv_cache_memory_mb={self.kv_cache_memory_mb} must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must "
                              "be in (0, 1]")
        if self.max_decode_stall != 0 and not self.max_decode_stall > 1:
            raise ConfigError(f"max_decode_stall={self.max_decode_stall} must be 0 (off) or "
                              "more than 1 (a step that decodes lasts at least a decode step)")
        if self.decode_steps < 1:
            raise ConfigError(f"decode_steps={self.decode_steps} must be >= 1 (1: one "
                              "forward pass per step)")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ConfigError(f"max_loras={self.max_loras} must be >= 0 and max_lora_rank="
                              f"{self.max_lora_rank} >= 1")
        if self.max_loaded_loras is not None and self.max_loaded_loras < 1:
            raise ConfigError(f"max_loaded_loras={self.max_loaded_loras} must be >= 1 (or "
                              "None: no limit)")
        if self.decode_steps > 1 and self.speculative is not None:
            raise ConfigError(f"decode_steps={self.decode_steps} cannot be combined with "
                              "speculative decoding, which already emits several tokens a "
                              "step; set decode_steps=1 or turn speculative decoding off")


def cache_root() -> Path:
    """lathe's cache folder: $LATHE_CACHE_DIR, else $XDG_CACHE_HOME/lathe (~/.cache/lathe)."""
    explicit = os.environ.get("LATHE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lathe"


def serving_engine() -> EngineConfig:
    """A server's engine: compiled decode steps, built while it already answers."""
    return EngineConfig(compile_decode=True, compile_in_background=True)


@dataclass
class ServerConfig:
    checkpoint: Path = field(metadata=cli("the checkpoint folder to serve", positional=True))
    host: str = field(default="127.0.0.1", metadata=cli(
        "interface to bind (127.0.0.1: this machine only)"))
    port: int = field(default=8000, metadata=cli("port to bind"))
    api_key: str | None = field(default=None, metadata=cli(
        "require 'Authorization: Bearer KEY' on every route but /health",
        env="LATHE_API_KEY"))
    protect_metrics: bool = field(default=False, metadata=cli(
        "/metrics needs the API key too (default: open, for scrapers)"))
    served_model_name: str | None = field(default=None, metadata=cli(
        "model id clients send (default: the checkpoint folder's name)"))
    log_level: LogLevel = field(default="info", metadata=cli(
        "the HTTP server's (uvicorn's) log level"))
    quantize: QuantMode | None = field(default=None, metadata=cli(
        "quantization applied at load: int8 / int4 weight-only, or fp8 (float8 weights per "
        "row, each token's inputs rounded to float8: W8A8, FP8 tensor cores on a GPU)"))
    dtype: WeightDtype = field(default="auto", metadata=cli(
        "the weights' dtype (auto: the checkpoint's). On a GPU the activations' too; on the "
        "CPU activations are float32 and bfloat16/float16 keep the linears and the embedding "
        "in half precision, halving the bytes a decode step reads"))
    max_waiting: int = field(default=256, metadata=cli(
        "queued requests before answering 429"))
    max_body_bytes: int = field(default=1 << 20, metadata=cli(
        "largest request body; past it 413"))
    template_seconds: float = field(default=2.0, metadata=cli(
        "seconds the chat template may take to render a request (it fails past them)",
        flag="--template-timeout"))
    chat_template: Path | None = field(default=None, metadata=cli(
        "a Jinja chat template served in place of the checkpoint's", metavar="FILE"))
    grammar_seconds: float = field(default=5.0, metadata=cli(
        "seconds a request's structured output may take to compile (a 400 past them)",
        flag="--grammar-timeout"))
    tool_call_parser: str | None = field(default=None, metadata=cli(
        "how this model writes tool calls (hermes: Qwen2.5/Qwen3/Hermes <tool_call> JSON; "
        "llama3_json: Llama 3.1+; mistral: [TOOL_CALLS]; qwen3_coder: Qwen3-Coder/Qwen3.5 "
        "<function=...>; glm45, glm47: GLM-4.5/4.6, GLM-4.7 <arg_key>; default: the one "
        "whose format the chat template writes; none: only tool_choice=none is served)",
        choices=(*PARSERS, "none")))
    max_tool_calls: int = field(default=8, metadata=cli(
        "calls one reply may make when tool_choice is \"required\""))
    reasoning_parser: str | None = field(default=None, metadata=cli(
        "how this model writes its reasoning, split into reasoning_content (qwen3, "
        "deepseek_r1: <think> blocks; mistral: Magistral's [THINK] blocks; default: the "
        "one whose markers the chat template renders, else none)",
        choices=(*REASONING_PARSERS, "none")))
    # vLLM's flag and default (its "vllm" is "none" here): `lathe.serve.sampling_defaults`
    generation_config: str = field(default="auto", metadata=cli(
        "the sampling defaults of requests that set none: auto takes the checkpoint's "
        "generation_config.json (its temperature, top_p, top_k, min_p, repetition_penalty; "
        "its max_new_tokens limits every request's output), none takes OpenAI's "
        "(temperature 1), or a folder holding a generation_config.json", metavar="auto|none|DIR"))
    responses_store: int = field(default=1000, metadata=cli(
        "Responses API responses kept in memory for previous_response_id and GET "
        "/v1/responses/{id}, the oldest dropped first (and past 256 MiB of them); 0: none",
        metavar="N"))
    trust_request_chat_template: bool = field(default=False, metadata=cli(
        "let requests bring their own chat_template (rendered with the same time and "
        "memory limits)"))
    loras: dict[str, Path] = field(default_factory=dict, metadata=cli(
        "serve a peft adapter folder over the base under NAME (a request's model picks it); "
        "repeatable", flag="--lora", metavar="NAME=DIR"))
    lora_roots: list[Path] = field(default_factory=list, metadata=cli(
        "a folder /v1/load_lora_adapter may load adapters from; repeatable (none: loading at "
        "run time is off; it needs --api-key too, unless "
        "--allow-unauthenticated-lora-loading)", flag="--lora-root", metavar="DIR"))
    allow_unauthenticated_lora_loading: bool = field(default=False, metadata=cli(
        "let /v1/load_lora_adapter run without --api-key (it is refused then: anyone "
        "reaching the port could load adapters)"))
    weight_roots: list[Path] = field(default_factory=list, metadata=cli(
        "a folder POST /update_weights may load new weights from (a trainer's pushes, e.g. "
        "GRPO's rollout.url); repeatable, needs --api-key (none: updates are off)",
        flag="--weights-root", metavar="DIR"))
    engine_threads: int | None = field(default=None, metadata=cli(
        "intra-op threads of the engine core, which runs in a process of its own beside the "
        "HTTP server (default: torch's, or OMP_NUM_THREADS; on a CPU one fewer for a model "
        "under 32 MiB of weights, whose steps are mostly Python: the HTTP side keeps a "
        "core)", metavar="N"))
    data_parallel_size: int = field(default=1, metadata=cli(
        "engine cores, each a whole replica of the model in a process of its own (on a GPU "
        "of its own where there is one for each; else sharing the CPU's threads), each "
        "request sent to the one with the fewest in flight; --max-waiting is each core's",
        metavar="N"))
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    engine: EngineConfig = field(default_factory=serving_engine)

    def __post_init__(self) -> None:
        self.checkpoint = Path(self.checkpoint)
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting={self.max_waiting} must be >= 0 (0: every "
                              "request that would wait is answered 429)")
        if self.responses_store < 0:
            raise ConfigError(f"responses_store={self.responses_store} must be >= 0 (0: keep "
                              "no responses)")
        for name in ("max_body_bytes", "max_tool_calls"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("template_seconds", "grammar_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        for name in ("engine_threads", "data_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        cpus = os.cpu_count() or 1
        if self.data_parallel_size > cpus:
            raise ConfigError(f"data_parallel_size={self.data_parallel_size}: each engine core "
                              f"is a process with a whole model and a CPU thread at least, and "
                              f"this machine has {cpus} CPUs; give at most {cpus}")
        if self.tool_call_parser not in (None, "none", *PARSERS):
            raise ConfigError(f"tool_call_parser={self.tool_call_parser!r}: choose one of "
                              f"{', '.join((*PARSERS, 'none'))}")
        if self.reasoning_parser not in (None, "none", *REASONING_PARSERS):
            raise ConfigError(f"reasoning_parser={self.reasoning_parser!r}: choose one of "
                              f"{', '.join((*REASONING_PARSERS, 'none'))}")
        if self.protect_metrics and not self.api_key:
            raise ConfigError("protect_metrics needs api_key (or $LATHE_API_KEY): without a "
                              "key /metrics would stay open; give a key or drop "
                              "protect_metrics")
        if self.weight_roots and not self.api_key:
            raise ConfigError("weight_roots needs api_key: anyone reaching the port could "
                              "otherwise replace the model")
        for name, what in (("lora_roots", "adapters are loaded from"),
                           ("weight_roots", "pushed weights are written to")):
            for root in getattr(self, name):
                if not Path(root).is_dir():
                    raise ConfigError(f"{name}: {root} is not a folder; give the folder "
                                      f"{what}")
        if self.generation_config not in ("auto", "none") \
                and not (Path(self.generation_config) / GENERATION_CONFIG_FILE).is_file():
            raise ConfigError(f"generation_config={self.generation_config!r}: give auto (the "
                              "checkpoint's sampling defaults), none (OpenAI's), or a folder "
                              "holding a generation_config.json")
        self._check_adapters()
        speculative = self.engine.speculative
        if speculative is not None and speculative.method == "draft" \
                and speculative.draft is None:
            raise ConfigError("engine.speculative.method=draft needs engine.speculative.draft, "
                              "a draft model checkpoint sharing this model's tokenizer")

    def _check_adapters(self) -> None:
        loaded = len(self.loras)
        if self.engine.max_loras == 0 and loaded:  # unset: a slot for each
            self.engine = dataclasses.replace(self.engine, max_loras=loaded)
        if self.engine.max_loras < loaded:
            raise ConfigError(f"engine.max_loras={self.engine.max_loras} holds fewer adapters "
                              f"than the {loaded} loaded at start; raise it")
        if self.engine.max_loaded_loras is not None \
                and self.engine.max_loaded_loras < max(loaded, 1):
            raise ConfigError(f"engine.max_loaded_loras={self.engine.max_loaded_loras} holds "
                              f"fewer adapters than the {loaded} loaded at start; raise it")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.checkpoint).resolve().name
