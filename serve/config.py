"""`ServerConfig`: everything `lathe serve` is told — the server's own settings, its
connection limits and its engine's — checked here once, whether it comes from flags
(generated from these fields by `lathe.core.config.add_config_flags`), a YAML file or code."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lathe.core.config import cli
from lathe.core.errors import ConfigError
from lathe.serve.connections import ConnectionLimits
from lathe.serve.engine import EngineConfig
from lathe.serve.quant import QuantMode
from lathe.serve.reasoning import REASONING_PARSERS
from lathe.serve.tool_calls import PARSERS

WeightDtype = Literal["auto", "float32", "bfloat16", "float16"]
LogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]


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
        "weight-only quantization applied at load"))
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
        "how this model writes tool calls (hermes: Qwen2.5/Qwen3/Hermes <tool_call>; "
        "llama3_json: Llama 3.1+; mistral: [TOOL_CALLS]); without it only tool_choice=none "
        "is served", choices=PARSERS))
    max_tool_calls: int = field(default=8, metadata=cli(
        "calls one reply may make when tool_choice is \"required\""))
    reasoning_parser: str | None = field(default=None, metadata=cli(
        "how this model writes its reasoning, split into reasoning_content (qwen3, "
        "deepseek_r1: <think> blocks; default: qwen3 when the chat template renders "
        "</think>, else none)", choices=(*REASONING_PARSERS, "none")))
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
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    engine: EngineConfig = field(default_factory=serving_engine)

    def __post_init__(self) -> None:
        self.checkpoint = Path(self.checkpoint)
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting={self.max_waiting} must be >= 0 (0: every "
                              "request that would wait is answered 429)")
        for name in ("max_body_bytes", "max_tool_calls"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("template_seconds", "grammar_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        if self.engine_threads is not None and self.engine_threads < 1:
            raise ConfigError(f"engine_threads={self.engine_threads} must be >= 1")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ConfigError(f"tool_call_parser={self.tool_call_parser!r}: choose one of "
                              f"{', '.join(PARSERS)}")
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
