"""What every route of the OpenAI-compatible server shares: the `Serving` state the app
holds (its config, metrics, engine and chat template once loaded, the parsers of replies),
the API key check, the engine a request may use, and OpenAI's error JSON."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse

from lathe.data.template_worker import TemplateWorker
from lathe.serve.background_responses import BackgroundResponses
from lathe.serve.config import ServerConfig
from lathe.serve.engine_pool import Engine
from lathe.serve.metrics import ServerMetrics
from lathe.serve.reasoning import ReasoningParser, reasoning_parser
from lathe.serve.request_checks import RequestError
from lathe.serve.response_store import ResponseStore
from lathe.serve.sampling_defaults import sampling_defaults
from lathe.serve.structured import GrammarError, Literals, StructuredOutput
from lathe.serve.tool_calls import ToolCallParser, tool_call_parser

RENDER_THREADS = 64  # chat-template renders waiting or running at once
RESPONSES_STORE_BYTES = 256 << 20  # the stored responses' JSON, at most


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)


def _printable(text: str) -> str:
    """Text that JSON-encodes as UTF-8 whatever a client sent (lone surrogates escaped)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": _printable(message), "type": kind,
                                   "param": None if param is None else _printable(param),
                                   "code": code}}, status_code=status)


def error_event(error: APIError) -> str:
    body = {"error": {"message": _printable(error.message), "type": error.kind,
                      "param": error.param, "code": error.code}}
    return f"data: {json.dumps(body)}\n\n"


class Serving:
    """The app's state (`app.state.serving`): fixed at build time, then filled in as the
    engine core and the chat template load."""

    def __init__(self, config: ServerConfig) -> None:
        self.config, self.name = config, config.model_name
        self.metrics = ServerMetrics(lambda: self.engine.stats if self.engine else None,
                                     self.name)
        self.tool_parser: ToolCallParser | None = tool_call_parser(config.tool_call_parser) \
            if config.tool_call_parser not in (None, "none") else None
        self.named_reasoning: ReasoningParser | None = reasoning_parser(
            config.reasoning_parser) if config.reasoning_parser not in (None, "none") else None
        self.engine: Engine | None = None
        self.template: TemplateWorker | None = None
        # renders wait on the template workers, whose queue serves clients fairly: threads
        # of their own, enough that a burst of one client's renders does not hold every
        # thread of the loop's default executor (and queue other renders behind it there)
        self.renders = concurrent.futures.ThreadPoolExecutor(RENDER_THREADS,
                                                             thread_name_prefix="lathe-render")
        self.no_template: str = "this checkpoint has no chat template; use /v1/completions"
        self.load_error: str | None = None
        self.warming: str | None = None  # how far the decode steps' warm-up is
        self.literals = Literals({})  # how grammars spell markers (the tokenizer's added tokens)
        self.reasoning: ReasoningParser | None = None
        # the checkpoint's recommended sampling (`--generation-config`), read before the port
        # is bound: a wrong file is refused at the start, not on every request
        self.sampling_defaults = sampling_defaults(config.generation_config, config.checkpoint)
        self.responses = ResponseStore(config.responses_store, RESPONSES_STORE_BYTES) \
            if config.responses_store else None
        self.background = BackgroundResponses()

    def ready(self, model: str | None = None) -> Engine:
        """The engine, for a request naming `model` (the base or one of its adapters); a 503
        while it loads or after it died, a 404 for another model."""
        if self.engine is None:
            raise APIError(503, "the model is still loading; poll GET /health",
                           kind="service_unavailable")
        if self.engine.dead is not None:
            raise APIError(503, str(self.engine.dead), kind="service_unavailable")
        served = [self.name, *self.engine.adapter_names]
        if model is not None and model not in served:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                           f"{', '.join(f'`{m}`' for m in served)}", param="model",
                           code="model_not_found")
        return self.engine

    async def compile_structured(self, engine: Engine,
                                 structured: tuple[str, StructuredOutput] | None,
                                 ) -> StructuredOutput | None:
        """Compile a request's structured output (and the field that asked for it) off the
        event loop, within `grammar_seconds` (the engine then finds it compiled); a 400
        naming the field when it does not compile or takes too long."""
        if structured is None:
            return None
        field, spec = structured
        seconds = self.config.grammar_seconds
        try:
            await asyncio.wait_for(asyncio.to_thread(engine.compile, spec), seconds)
        except TimeoutError:
            raise APIError(400, f"{field}: did not compile within {seconds:g} s; simplify it",
                           param=field) from None
        except (GrammarError, RequestError) as error:
            raise APIError(400, f"{field}: {error}", param=field) from None
        return spec


def serving(request: Request) -> Serving:
    return request.app.state.serving


# async: FastAPI runs a plain function dependency on its thread pool, a thread hop (and a
# GIL hand-over) in front of every request
async def authorize(request: Request) -> None:
    """The API key check of every route but /health (and /metrics unless protected)."""
    key_wanted = serving(request).config.api_key
    if key_wanted is None:
        return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                             key_wanted.encode()):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


async def authorize_metrics(request: Request) -> None:
    if serving(request).config.protect_metrics:
        await authorize(request)


def inside(given: str, roots: list[Path], param: str, flag: str) -> Path:
    """`given` resolved, when it lies inside one of `roots` (the folders `flag` named); a 403
    naming them otherwise."""
    path = Path(given).resolve()
    if not any(path.is_relative_to(root.resolve()) for root in roots):
        raise APIError(403, f"{param} {given!r} is not inside a {flag} ("
                            + ", ".join(str(root) for root in roots) + ")", param=param,
                       code=f"{param}_not_allowed")
    return path
