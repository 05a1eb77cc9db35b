"""lathe.serve: the inference engine (scheduler, paged KV cache, sampling), quantization,
the OpenAI-compatible HTTP server, the chat CLI and exports (see docs/design.md). Never imports
a training package."""

from lathe.serve.async_engine import AsyncEngine
from lathe.serve.engine import EngineConfig, LLMEngine, RequestError
from lathe.serve.outputs import Completion
from lathe.serve.sampling import SamplingParams

__all__ = ["AsyncEngine", "Completion", "EngineConfig", "LLMEngine", "RequestError",
           "SamplingParams"]
