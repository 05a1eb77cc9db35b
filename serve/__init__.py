"""lathe.serve: the inference engine (scheduler, paged KV cache, sampling), quantization,
the OpenAI-compatible HTTP server, the chat CLI and exports (see docs/design.md). Never imports
a training package.

The names below are imported on first use, so that a child process running one of this
package's small modules (`python -m lathe.serve.grammar_check`) does not import the engine
and torch with the package."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"AsyncEngine": "lathe.serve.async_engine", "Completion": "lathe.serve.outputs",
            "EngineConfig": "lathe.serve.engine", "LLMEngine": "lathe.serve.engine",
            "RequestError": "lathe.serve.engine", "SamplingParams": "lathe.serve.sampling"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lathe.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
