"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of one `AsyncEngine`.

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (JSON or
Server-Sent Events), `GET /health` (503 until the model has loaded) and `GET /metrics`
(Prometheus). Every error is OpenAI's error JSON: 400 for invalid input (naming the field
and its range, or the prompt length and the context window), 401 without the configured
API key, 404 for an unknown model or path, 413 for an oversized body, 429 when the
waiting queue is full; bad input never reaches a 500. A streaming client that disconnects
is aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from lathe.serve.async_engine import AsyncEngine, QueueFull
from lathe.serve.chat_template import ChatTemplate, ChatTemplateError
from lathe.serve.engine import CompletionOutput, EngineConfig, LLMEngine, RequestError
from lathe.serve.metrics import RequestTimer, ServerMetrics
from lathe.serve.protocol import ChatCompletionRequest, CompletionRequest, ResponseBuilder
from lathe.serve.quant import QuantMode
from lathe.serve.sampling import SamplingError, SamplingParams

log = logging.getLogger("lathe.serve")


@dataclass
class ServerConfig:
    checkpoint: Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    quantize: QuantMode | None = None
    max_waiting: int = 256
    max_body_bytes: int = 1 << 20
    engine: EngineConfig = field(default_factory=EngineConfig)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.checkpoint).resolve().name


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


class BodyLimit:
    """Reject request bodies over `max_bytes` (by Content-Length) with a 413."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and int(length) > self.max_bytes:
                response = error_response(413, f"request body of {int(length)} bytes exceeds "
                                          f"the server's limit of {self.max_bytes} bytes")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _State:
    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None
        self.template: ChatTemplate | None = None
        self.load_error: str | None = None


def build_app(config: ServerConfig, load: Callable[[], LLMEngine] | None = None) -> FastAPI:
    """The app; the engine loads in the background after startup (`load` overrides how)."""
    state = _State()
    name = config.model_name
    metrics = ServerMetrics(lambda: state.engine.engine if state.engine else None, name)
    load = load or (lambda: LLMEngine.from_checkpoint(config.checkpoint, config.engine,
                                                      quantize=config.quantize))

    async def load_engine() -> None:
        try:
            engine = await asyncio.to_thread(load)
            try:
                state.template = ChatTemplate.from_checkpoint(config.checkpoint)
            except ValueError as error:
                log.warning("chat completions disabled: %s", error)
        except Exception as error:
            state.load_error = f"{type(error).__name__}: {error}"
            log.exception("loading %s failed; shutting down", config.checkpoint)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        state.engine = AsyncEngine(engine, config.max_waiting)
        state.engine.start()
        log.info("serving %s as %r", config.checkpoint, name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(load_engine())
        yield
        loader.cancel()
        if state.engine is not None:
            await state.engine.stop()

    app = FastAPI(title="lathe", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error.status, error.message, error.kind, error.param, error.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        return error_response(400, f"{where or 'body'}: {first['msg']}", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = (f"no route {request.method} {request.url.path}" if error.status_code == 404
                   else str(error.detail))
        return error_response(error.status_code, message, code="not_found"
                              if error.status_code == 404 else None)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {config.api_key}":
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def ready(model: str | None = None) -> AsyncEngine:
        if state.engine is None:
            raise APIError(503, "the model is still loading; poll GET /health",
                           kind="service_unavailable")
        if model is not None and model != name:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                           f"`{name}`", param="model", code="model_not_found")
        return state.engine

    @app.get("/health")
    async def health() -> Response:
        if state.engine is None:
            return JSONResponse({"status": state.load_error or "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        engine = ready()
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "lathe",
            "max_model_len": engine.engine.max_model_len}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest) -> Response:
        engine = ready(body.model)
        prompts = _prompt_ids(engine.engine, body.prompt)
        window = engine.engine.max_model_len
        params = [_params(body, body.max_tokens if body.max_tokens is not None
                          else window - len(p), body.logprobs) for p in prompts]
        builder = ResponseBuilder("completion", name, engine.engine.tokenizer)
        return await _respond(engine, metrics, builder, body, prompts, params,
                              body.logprobs is not None)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        engine = ready(body.model)
        if state.template is None:
            raise APIError(400, "this checkpoint has no chat template; use /v1/completions")
        try:
            text = state.template.render([{"role": m.role, "content": m.text()}
                                          for m in body.messages])
            prompt = engine.engine.encode(text)
        except (ChatTemplateError, RequestError) as error:
            raise APIError(400, str(error), param="messages") from None
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(engine.engine.max_model_len - len(prompt), 1)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        builder = ResponseBuilder("chat", name, engine.engine.tokenizer)
        return await _respond(engine, metrics, builder, body, [prompt],
                              [_params(body, max_tokens, logprobs)], body.logprobs)

    return app


def _prompt_ids(engine: LLMEngine, prompt: str | list) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt is an empty list; give a string, strings or token ids",
                       param="prompt")
    try:
        return [engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    except RequestError as error:
        raise APIError(400, str(error), param="prompt") from None


def _params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
            logprobs: int | None) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs)
    except SamplingError as error:
        raise APIError(400, str(error), param=str(error).split("=")[0]) from None


async def _respond(engine: AsyncEngine, metrics: ServerMetrics, builder: ResponseBuilder,
                   body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                   params: list[SamplingParams], want_logprobs: bool) -> Response:
    request_ids: list[str] = []
    try:
        for prompt, p in zip(prompts, params, strict=True):
            engine.engine.validate(prompt, p)
        for prompt, p in zip(prompts, params, strict=True):
            request_ids.append(engine.submit(prompt, p))
    except RequestError as error:
        raise APIError(400, str(error), param="max_tokens" if "max_tokens" in str(error)
                       else "prompt") from None
    except QueueFull as error:
        for request_id in request_ids:  # the prompts accepted before the queue filled up
            engine.abort(request_id)
        raise APIError(429, str(error), kind="rate_limit_exceeded") from None
    n = params[0].n
    prompt_tokens = sum(len(p) for p in prompts)
    streams = [engine.results(r, n) for r in request_ids]
    timer = RequestTimer(metrics)
    if not body.stream:
        outputs = [CompletionOutput(i) for i in range(len(prompts) * n)]
        async for prompt_index, delta in _merge(streams):
            index = prompt_index * n + delta.index
            for _ in delta.token_ids:
                timer.token(index)
            outputs[index].add(delta)
        timer.done()
        return JSONResponse(builder.response(outputs, want_logprobs, prompt_tokens))

    async def events() -> AsyncIterator[str]:
        completion_tokens, started = 0, set()
        async for prompt_index, delta in _merge(streams):
            index = prompt_index * n + delta.index
            for _ in delta.token_ids:
                timer.token(index)
            completion_tokens += len(delta.token_ids)
            chunk = builder.chunk(index, delta.text, delta.logprobs if want_logprobs else None,
                                  delta.finish_reason, first=index not in started)
            started.add(index)
            yield f"data: {json.dumps(chunk)}\n\n"
        timer.done()
        if body.include_usage:
            yield f"data: {json.dumps(builder.usage_chunk(prompt_tokens, completion_tokens))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as (which, item); closing this closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(which: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                queue.put_nowait((which, item))
        except Exception as error:
            queue.put_nowait((which, error))
        finally:
            queue.put_nowait((which, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            which, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield which, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
