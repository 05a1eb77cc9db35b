"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of one `AsyncEngine` (or an
`EnginePool` of them: `--data-parallel-size`).

`run` serves it within `connections`' limits (header, body and idle deadlines, a
connection cap past which only /health answers, a bounded drain at shutdown).

Routes, grouped as vLLM's OpenAI serving modules: `lathe.serve.serving_models` (`GET
/v1/models` and `/v1/models/{id}`, `GET /health` — 503 until the model has loaded and its
compiled decode steps are warmed up, saying what the start waits for, and for good once
the engine has failed — `GET /metrics` for Prometheus, LoRA adapters and weight updates),
`lathe.serve.serving_completions` (`POST /v1/completions`) and `lathe.serve.serving_chat`
(`POST /v1/chat/completions`), each as JSON or Server-Sent Events; what they share is in
`lathe.serve.serving`. Chat replies have their reasoning split off (`--reasoning-parser`)
and their tool calls read (`--tool-call-parser`) by `lathe.serve.replies`.
Every error is OpenAI's error JSON: 400 for invalid or unsupported input (naming the
field), 401 without the configured API key, 404 for an unknown model or path, 413 for a
body over the limit (counted on the bytes read, chunked or not), 429 when the waiting
queue is full, 503 while loading or after an engine failure. A bad request fails alone and
never reaches a 500. A client that disconnects, streaming or not, is aborted and its KV
blocks freed.

With an API key, every route but /health needs it (compared in constant time, any case
of the `Bearer` scheme); /metrics too when `protect_metrics` is set. The interactive docs
are then off and /openapi.json needs the key.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lathe.core.errors import ConfigError, LatheError
from lathe.data.chat_template import read_chat_template
from lathe.data.template_worker import TemplateWorker
from lathe.serve import (
    serving_chat,
    serving_completions,
    serving_models,
    serving_responses,
    serving_tokens,
)
from lathe.serve.async_engine import AsyncEngine, EngineDead
from lathe.serve.config import ServerConfig
from lathe.serve.connections import LatheServer, raise_file_limit, uvicorn_config
from lathe.serve.core_messages import EngineSpec, freeze_startup_heap
from lathe.serve.engine_pool import EnginePool
from lathe.serve.reasoning import template_reasoning_parser
from lathe.serve.serving import APIError, Serving, authorize, error_response
from lathe.serve.structured import Literals
from lathe.serve.tool_calls import template_tool_call_parser

if TYPE_CHECKING:  # the front end imports no torch: only a `load` brings an engine
    from lathe.serve.engine import LLMEngine

log = logging.getLogger("lathe.serve")
_UNION_TAGS = ("str", "int", "float", "bool")


class BodyLimit:
    """Answer 413 to request bodies over `max_bytes`, counting the bytes as they arrive
    (a chunked body declares no Content-Length); a body within the limit is replayed to
    the app unchanged."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        size = int(declared) if declared.isdigit() else 0
        messages: list[dict] = []
        while size <= self.max_bytes:
            message = await receive()
            messages.append(message)
            if message["type"] == "http.disconnect":
                return  # gone (or cut off by the body deadline) before its body was complete
            if message["type"] != "http.request":
                break
            if not messages[:-1]:
                size = 0  # from here on, count what really arrives
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        if size > self.max_bytes:
            response = error_response(413, f"request body exceeds the server's limit of "
                                      f"{self.max_bytes} bytes")
            await response(scope, receive, send)
            return

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def start_progress(ctx: Serving) -> Callable[[str], None]:
    """Reports what the engine core's start waits for (a native kernel build, each compiled
    decode step built at warm-up), in the log and in /health."""
    start = time.monotonic()

    def progress(status: str) -> None:
        ctx.warming = status
        log.info("%s (%.1f s)", status, time.monotonic() - start)
    return progress


def run(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT, within the connection limits (see `connections`) —
    or until the engine core dies: a server that can only answer 503 exits (non-zero,
    `LatheError`), for its supervisor to restart it, as vLLM's does."""
    limits = raise_file_limit(config.limits)
    app = build_app(config)
    server = LatheServer(uvicorn_config(app, config.host, config.port, limits,
                                        config.log_level),
                         before_cut=app.state.end_requests)
    app.state.on_engine_death = lambda: setattr(server, "should_exit", True)
    server.run()
    if app.state.engine_death is not None:
        raise LatheError(f"{app.state.engine_death}; the server has exited")


def build_app(config: ServerConfig, load: Callable[[], LLMEngine] | None = None) -> FastAPI:
    """The app; the engine core starts in the background after startup, in a process of its
    own — or, given `load` (an engine built in this process: tests, embedding), on a thread
    of this one. Its routes are `serving_models`', `serving_completions`' and
    `serving_chat`'; they find what they share in `app.state.serving`."""
    ctx = Serving(config)
    spec = None if load is not None else EngineSpec(config.checkpoint, config.engine,
                                                    config.quantize, config.dtype,
                                                    config.engine_threads)
    if load is not None and config.data_parallel_size > 1:
        raise ConfigError(f"data_parallel_size={config.data_parallel_size} starts each engine "
                          "core in a process of its own from the checkpoint; an engine built "
                          "in this process (load) is one core")

    async def load_engine() -> None:
        engine = None
        try:
            if config.data_parallel_size > 1:
                engine = await EnginePool.launch(spec, config.data_parallel_size,
                                                 loras=config.loras,
                                                 max_waiting=config.max_waiting,
                                                 status=start_progress(ctx))
            else:
                engine = await AsyncEngine.launch(spec, load=load, loras=config.loras,
                                                  max_waiting=config.max_waiting,
                                                  status=start_progress(ctx))
            ctx.literals = Literals.of(engine.tokenizer)
            try:
                source, special_tokens = read_chat_template(config.checkpoint,
                                                            config.chat_template)
                ctx.reasoning = ctx.named_reasoning if config.reasoning_parser is not None \
                    else template_reasoning_parser(source)
                if config.tool_call_parser is None:
                    ctx.tool_parser = template_tool_call_parser(source)
                    if ctx.tool_parser is not None:
                        log.info("tool calls read as %s (the chat template's format; "
                                 "--tool-call-parser names another)", ctx.tool_parser.name)
                elif ctx.tool_parser is not None:
                    ctx.tool_parser = ctx.tool_parser.for_template(source)
                template = TemplateWorker(source, special_tokens,
                                          seconds=config.template_seconds)
                ctx.template = template
                await asyncio.to_thread(template.check)
            except ValueError as error:
                if ctx.template is not None:
                    ctx.template.close()
                ctx.template = None
                ctx.no_template = f"chat completions are off for this checkpoint: {error}"
                log.warning("chat completions disabled: %s", error)
        except Exception as error:
            ctx.load_error = f"{type(error).__name__}: {error}"
            if isinstance(error, LatheError):  # a user's to fix: the message says it all
                log.error("cannot serve %s: %s; shutting down", config.checkpoint, error)
            else:
                log.exception("loading %s failed; shutting down", config.checkpoint)
            if engine is not None:
                await engine.stop()
            os.kill(os.getpid(), signal.SIGTERM)
            return
        freeze_startup_heap()
        engine.on_death = died
        ctx.engine = engine
        log.info("serving %s as %r (engine core: %d intra-op threads)", config.checkpoint,
                 ctx.name, engine.info.threads)
        if ctx.sampling_defaults:
            log.info("requests that do not set them sample with %s, from the generation "
                     "config (--generation-config none: OpenAI's defaults)",
                     ctx.sampling_defaults)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(load_engine())
        yield
        loader.cancel()
        await ctx.background.close()
        if ctx.template is not None:
            ctx.template.close()
        ctx.renders.shutdown(wait=False, cancel_futures=True)
        if ctx.engine is not None:
            await ctx.engine.stop()
        gc.unfreeze()  # the exit frees what the start froze (else extensions report leaks)

    keyed = config.api_key is not None
    app = FastAPI(title="lathe", lifespan=lifespan, docs_url=None if keyed else "/docs",
                  redoc_url=None if keyed else "/redoc",
                  openapi_url=None if keyed else "/openapi.json")
    app.state.serving = ctx
    app.state.engine_death = None  # the engine's EngineDead, once it has died
    app.state.on_engine_death = None  # what `run` does then: stop serving

    def end_requests() -> None:  # the shutdown's drain is about to run out
        if ctx.engine is not None:
            ctx.engine.end_requests("the server is shutting down and its drain time "
                                    "(--shutdown-timeout) is up; retry on another server")
    app.state.end_requests = end_requests

    def died(dead: EngineDead) -> None:
        app.state.engine_death = dead
        if app.state.on_engine_death is not None:
            app.state.on_engine_death()
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.kind, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error.errors())
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = (f"no route {request.method} {request.url.path}" if error.status_code == 404
                   else str(error.detail))
        return error_response(error.status_code, message, code="not_found"
                              if error.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def server_fault(request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(error).__name__}",
                              kind="internal_server_error")

    if keyed:
        @app.get("/openapi.json", dependencies=[Depends(authorize)], include_in_schema=False)
        async def openapi() -> dict[str, Any]:
            return app.openapi()

    for router in (serving_models.open_router, serving_models.router,
                   serving_completions.router, serving_chat.router, serving_responses.router,
                   serving_tokens.router):
        app.include_router(router)
    return app


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic's errors as one (message, param): the most telling one — of a union's
    members, the one that got furthest rather than a plain type mismatch — with the
    field's path (no body, no union-member tags); a value out of bounds with its range."""
    error = max(errors, key=lambda e: (not e["type"].endswith("_type"), len(e["loc"])))
    if error["type"] == "json_invalid":  # its loc is the character offset, not a field
        return f"the body is not valid JSON: {error['msg']} at character {error['loc'][-1]}", \
            None
    where = ".".join(str(part) for part in error["loc"] if part != "body" and not (
        isinstance(part, str) and ("[" in part or part in _UNION_TAGS)))
    if error["type"] == "out_of_bounds":
        value = repr(error["input"])
        value = value if len(value) <= 40 else value[:37] + "..."
        return f"{where}={value} {error['msg']}", where
    return (f"{where}: {error['msg']}" if where else error["msg"]), where or None
