"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of one `AsyncEngine`.

`run` serves it within `connections`' limits (header, body and idle deadlines, a
connection cap past which only /health answers, a bounded drain at shutdown).

Routes: `GET /v1/models` (and `/v1/models/{id}`), `POST /v1/completions`,
`POST /v1/chat/completions` (JSON or Server-Sent Events), `GET /health` (503 until the
model has loaded and its compiled decode steps are warmed up, saying what the start waits
for, and for good once the engine has failed) and `GET /metrics` (Prometheus). Chat
replies have their reasoning split off (`--reasoning-parser`) and their tool calls read
(`--tool-call-parser`) by `lathe.serve.replies`.
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
import concurrent.futures
import gc
import hmac
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from lathe.core.errors import LatheError
from lathe.data.chat_template import CHECK_TOOLS, ChatTemplateError, read_chat_template
from lathe.data.template_worker import TemplateWorker
from lathe.model.checkpoint import CheckpointError
from lathe.serve.adapters import AdapterError
from lathe.serve.async_engine import AsyncEngine, EngineDead, QueueFull, ServerClosing
from lathe.serve.config import ServerConfig
from lathe.serve.connections import (
    LatheServer,
    raise_file_limit,
    uvicorn_config,
)
from lathe.serve.engine import LLMEngine
from lathe.serve.engine_core import EngineSpec, freeze_startup_heap
from lathe.serve.metrics import RequestTimer, ServerMetrics
from lathe.serve.outputs import CompletionOutput
from lathe.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Echo,
    LoraAdapterRequest,
    ProtocolError,
    ResponseBuilder,
    ResponseOptions,
    UpdateWeightsRequest,
)
from lathe.serve.quant import WEIGHT_DTYPES
from lathe.serve.reasoning import ReasoningParser, reasoning_parser, template_reasoning_parser
from lathe.serve.replies import ReplyFormat
from lathe.serve.request_checks import RequestError
from lathe.serve.sampling import SamplingError, SamplingParams
from lathe.serve.structured import GrammarError, Literals, StructuredOutput
from lathe.serve.tool_calls import tool_call_parser

log = logging.getLogger("lathe.serve")
RENDER_THREADS = 64  # chat-template renders waiting or running at once


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


class _State:
    def __init__(self) -> None:
        self.engine: AsyncEngine | None = None
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


def start_progress(state: _State) -> Callable[[str], None]:
    """Reports what the engine core's start waits for (a native kernel build, each compiled
    decode step built at warm-up), in the log and in /health."""
    start = time.monotonic()

    def progress(status: str) -> None:
        state.warming = status
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
    of this one."""
    state = _State()
    name = config.model_name
    metrics = ServerMetrics(lambda: state.engine.stats if state.engine else None, name)
    tool_parser = tool_call_parser(config.tool_call_parser) \
        if config.tool_call_parser is not None else None
    named_reasoning = reasoning_parser(config.reasoning_parser) \
        if config.reasoning_parser not in (None, "none") else None
    spec = None if load is not None else EngineSpec(config.checkpoint, config.engine,
                                                    config.quantize, WEIGHT_DTYPES[config.dtype],
                                                    config.engine_threads)

    async def load_engine() -> None:
        engine = None
        try:
            engine = await AsyncEngine.launch(spec, load=load, loras=config.loras,
                                              max_waiting=config.max_waiting,
                                              status=start_progress(state))
            state.literals = Literals.of(engine.tokenizer)
            try:
                source, special_tokens = read_chat_template(config.checkpoint,
                                                            config.chat_template)
                state.reasoning = named_reasoning if config.reasoning_parser is not None \
                    else template_reasoning_parser(source)
                template = TemplateWorker(source, special_tokens,
                                          seconds=config.template_seconds)
                state.template = template
                await asyncio.to_thread(template.check)
            except ValueError as error:
                if state.template is not None:
                    state.template.close()
                state.template = None
                state.no_template = f"chat completions are off for this checkpoint: {error}"
                log.warning("chat completions disabled: %s", error)
        except Exception as error:
            state.load_error = f"{type(error).__name__}: {error}"
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
        state.engine = engine
        log.info("serving %s as %r (engine core: %d intra-op threads)", config.checkpoint,
                 name, engine.info.threads)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(load_engine())
        yield
        loader.cancel()
        if state.template is not None:
            state.template.close()
        state.renders.shutdown(wait=False, cancel_futures=True)
        if state.engine is not None:
            await state.engine.stop()
        gc.unfreeze()  # the exit frees what the start froze (else extensions report leaks)

    keyed = config.api_key is not None
    app = FastAPI(title="lathe", lifespan=lifespan, docs_url=None if keyed else "/docs",
                  redoc_url=None if keyed else "/redoc",
                  openapi_url=None if keyed else "/openapi.json")
    app.state.engine_death = None  # the engine's EngineDead, once it has died
    app.state.on_engine_death = None  # what `run` does then: stop serving

    def end_requests() -> None:  # the shutdown's drain is about to run out
        if state.engine is not None:
            state.engine.end_requests("the server is shutting down and its drain time "
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

    # async: FastAPI runs a plain function dependency on its thread pool, a thread hop
    # (and a GIL hand-over) in front of every request
    async def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                key.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def ready(model: str | None = None) -> AsyncEngine:
        if state.engine is None:
            raise APIError(503, "the model is still loading; poll GET /health",
                           kind="service_unavailable")
        if state.engine.dead is not None:
            raise APIError(503, str(state.engine.dead), kind="service_unavailable")
        served = [name, *state.engine.adapter_names]
        if model is not None and model not in served:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                           f"{', '.join(f'`{m}`' for m in served)}", param="model",
                           code="model_not_found")
        return state.engine

    @app.get("/health")
    async def health() -> Response:
        if state.engine is None:
            if state.load_error is not None:
                return JSONResponse({"status": state.load_error}, status_code=503)
            return JSONResponse({"status": "loading", "detail": state.warming
                                 or f"loading {config.checkpoint}"}, status_code=503)
        if state.engine.dead is not None:
            return JSONResponse({"status": str(state.engine.dead)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", dependencies=[Depends(authorize)] if config.protect_metrics else [])
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if keyed:
        @app.get("/openapi.json", dependencies=[Depends(authorize)], include_in_schema=False)
        async def openapi() -> dict[str, Any]:
            return app.openapi()

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        engine = ready()
        created = int(time.time())
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "lathe",
            "root": str(config.checkpoint), "parent": None,
            "max_model_len": engine.max_model_len}] + [{
                "id": adapter, "object": "model", "created": created, "owned_by": "lathe",
                "root": engine.adapter_path(adapter),
                "parent": name, "max_model_len": engine.max_model_len}
                for adapter in engine.adapter_names]}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorize)])
    async def model_card(model: str) -> dict[str, Any]:
        ready(model)
        return next(card for card in (await models())["data"] if card["id"] == model)

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(authorize)])
    async def load_lora_adapter(body: LoraAdapterRequest) -> Response:
        engine = ready()
        if config.api_key is None and not config.allow_unauthenticated_lora_loading:
            raise APIError(403, "loading adapters at run time needs the server's --api-key "
                                "(or, on a trusted network, --allow-unauthenticated-lora-"
                                "loading)", code="lora_loading_disabled")
        if not config.lora_roots:
            raise APIError(403, "loading adapters at run time is off: start the server with "
                                "--lora-root DIR, the folder adapters may be loaded from",
                           code="lora_loading_disabled")
        if body.lora_path is None:
            raise APIError(400, "lora_path is required: the adapter folder to load",
                           param="lora_path")
        path = _inside(body.lora_path, config.lora_roots, "lora_path", "--lora-root")
        if body.lora_name == name:
            raise APIError(400, f"lora_name `{name}` is the base model's name; choose another",
                           param="lora_name")
        try:
            await engine.add_adapter(body.lora_name, str(path))
        except (AdapterError, CheckpointError) as error:
            raise APIError(400, str(error), param="lora_path") from None
        log.info("loaded LoRA adapter %r from %s", body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(authorize)])
    async def unload_lora_adapter(body: LoraAdapterRequest) -> Response:
        engine = ready()
        try:
            await engine.remove_adapter(body.lora_name)
        except AdapterError as error:
            raise APIError(404, str(error), param="lora_name",
                           code="model_not_found") from None
        log.info("unloaded LoRA adapter %r", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")

    @app.post("/update_weights", dependencies=[Depends(authorize)])
    async def update_weights(body: UpdateWeightsRequest) -> dict[str, Any]:
        """New weights for the served model (a trainer's push, TRL's vllm-serve role):
        admission pauses while the running requests finish on the old weights."""
        engine = ready()
        if config.api_key is None:
            raise APIError(403, "updating weights needs the server's --api-key",
                           code="weight_updates_disabled")
        if not config.weight_roots:
            raise APIError(403, "updating weights is off: start the server with "
                                "--weights-root DIR, the folder pushes may be read from",
                           code="weight_updates_disabled")
        path = _inside(body.path, config.weight_roots, "path", "--weights-root")
        try:
            version = await engine.update_weights(path)
        except (CheckpointError, RuntimeError) as error:
            raise APIError(400, str(error), param="path") from None
        log.info("loaded weights version %d from %s", version, path)
        return {"status": "ok", "weight_version": version}

    async def compile_structured(engine: AsyncEngine,
                                 structured: tuple[str, StructuredOutput] | None,
                                 ) -> StructuredOutput | None:
        """Compile a request's structured output (and the field that asked for it) off the
        event loop, within `grammar_seconds` (the engine then finds it compiled); a 400
        naming the field when it does not compile or takes too long."""
        if structured is None:
            return None
        field, spec = structured
        try:
            await asyncio.wait_for(asyncio.to_thread(engine.compile, spec),
                                   config.grammar_seconds)
        except TimeoutError:
            raise APIError(400, f"{field}: did not compile within {config.grammar_seconds:g} "
                                "s; simplify it", param=field) from None
        except (GrammarError, RequestError) as error:
            raise APIError(400, f"{field}: {error}", param=field) from None
        return spec

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _supported(body)
        engine = ready(body.model)
        structured = await compile_structured(engine, _structured(body, state.literals))
        given = _prompt_list(body.prompt)
        prompts = [_truncated(engine, p, body.truncate_prompt_tokens)
                   for p in await _prompt_ids(engine, given, body.add_special_tokens)]
        window = engine.max_model_len
        # echo with max_tokens=0 scores the prompt: one token is generated and dropped
        score_only = body.echo and body.max_tokens == 0
        logprobs = body.logprobs
        prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None \
            else logprobs if body.echo else None

        def budget(prompt: list[int]) -> int:
            if score_only:
                return 1
            return body.max_tokens if body.max_tokens is not None else window - len(prompt)

        bad_words = _bad_words(engine, body)
        params = [_params(body, budget(p), logprobs, prompt_logprobs, structured, bad_words,
                          score_only=score_only) for p in prompts]
        echoes = [Echo(g if isinstance(g, str) and not body.truncate_prompt_tokens else None,
                       ids) for g, ids in zip(given, prompts, strict=True)] \
            if body.echo else None
        builder = ResponseBuilder("completion", name, engine.tokenizer, ResponseOptions(
            prompts, params[0].n, body.return_token_ids, body.prompt_logprobs is not None,
            request_id=body.request_id))
        return await _respond(request, engine, metrics, builder, body, prompts, params,
                              logprobs is not None, echoes, score_only)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _supported(body)
        engine = ready(body.model)
        if state.template is None:
            raise APIError(400, state.no_template)
        if body.chat_template is not None and not config.trust_request_chat_template:
            raise APIError(400, "chat_template: this server renders its own chat template "
                                "only; start it with --trust-request-chat-template to take "
                                "templates from requests", param="chat_template")
        try:
            plan = body.tool_plan(tool_parser, state.literals, config.max_tool_calls)
        except ProtocolError as error:
            raise APIError(400, str(error), param=error.param) from None
        asked = _structured(body, state.literals)
        if plan is not None and plan.structured is not None:
            if asked is not None:
                raise APIError(400, f"tool_choice forces a tool call, which {asked[0]} "
                                    "cannot constrain as well; send one of them",
                               param=asked[0])
            asked = ("tool_choice", plan.structured)
        structured = await compile_structured(engine, asked)
        tools = plan.tools if plan is not None else None
        try:
            messages = body.chat()
            kwargs = {**body.template_kwargs(), "template": body.chat_template,
                      "continue_final_message": body.continue_final_message}

            client = request.client.host if request.client else ""

            def render(with_tools: list[dict[str, Any]] | None) -> str:
                return state.template.render(messages, body.add_generation_prompt, with_tools,
                                             body.documents, client=client, **kwargs)
            loop = asyncio.get_running_loop()
            text = await loop.run_in_executor(state.renders, render, tools)
            if tools and not await loop.run_in_executor(state.renders, _shows_tools, render,
                                                        text):
                raise APIError(400, "this checkpoint's chat template does not render tools, "
                                    "so the model would never see them; serve it with a "
                                    "template that does (--chat-template)", param="tools")
        except ChatTemplateError as error:
            if tools is None and await asyncio.get_running_loop().run_in_executor(
                    state.renders, _renders_with_tools, render):
                raise APIError(400, f"this chat template needs tools to render ({error}); "
                                    "send tools, or serve another template (--chat-template)",
                               param="messages") from None
            raise APIError(400, str(error), param="messages") from None
        except ProtocolError as error:
            raise APIError(400, str(error), param="messages") from None
        try:
            prompt = _truncated(engine, await asyncio.to_thread(
                engine.encode, text, body.add_special_tokens), body.truncate_prompt_tokens)
        except RequestError as error:
            raise APIError(400, str(error), param="messages") from None
        max_tokens = body.completion_budget
        if max_tokens is None:
            max_tokens = max(engine.max_model_len - len(prompt), 1)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        reasoning = state.reasoning
        reply = ReplyFormat(reasoning, reasoning is not None and reasoning.starts_inside(text),
                            plan.parser if plan is not None else None,
                            plan is not None and plan.named)
        # the parsers read markers that may be special tokens (Mistral's [TOOL_CALLS])
        keep_markers = reply.tools is not None or reply.reasoning is not None
        params = _params(body, max_tokens, logprobs, body.prompt_logprobs, structured,
                         _bad_words(engine, body), False if keep_markers else None)
        builder = ResponseBuilder("chat", name, engine.tokenizer, ResponseOptions(
            [prompt], params.n, body.return_token_ids, body.prompt_logprobs is not None,
            reply, body.include_reasoning, body.request_id))
        return await _respond(request, engine, metrics, builder, body, [prompt], [params],
                              bool(body.logprobs))

    return app


_UNION_TAGS = ("str", "int", "float", "bool")


def _inside(given: str, roots: list[Path], param: str, flag: str) -> Path:
    """`given` resolved, when it lies inside one of `roots` (the folders `flag` named); a 403
    naming them otherwise."""
    path = Path(given).resolve()
    if not any(path.is_relative_to(root.resolve()) for root in roots):
        raise APIError(403, f"{param} {given!r} is not inside a {flag} ("
                            + ", ".join(str(root) for root in roots) + ")", param=param,
                       code=f"{param}_not_allowed")
    return path


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


def _renders_with_tools(render: Callable[[list[dict[str, Any]] | None], str]) -> bool:
    try:
        render(CHECK_TOOLS)
    except ChatTemplateError:
        return False
    return True


def _shows_tools(render: Callable[[list[dict[str, Any]] | None], str], text: str) -> bool:
    """Whether `text`, rendered with tools, differs from the chat rendered without them
    (a template that fails without tools surely shows them)."""
    try:
        return render(None) != text
    except ChatTemplateError:
        return True


def _structured(body: CompletionRequest | ChatCompletionRequest,
                literals: Literals) -> tuple[str, StructuredOutput] | None:
    try:
        return body.structured_output(literals)
    except ProtocolError as error:
        raise APIError(400, str(error), param=error.param) from None


def _truncated(engine: AsyncEngine, prompt: list[int], keep: int | None) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as
    the context window holds)."""
    if keep is None:
        return prompt
    keep = engine.max_model_len if keep == -1 else keep
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens=0 would leave no prompt; give at least 1 "
                            "(or -1 for the context window)", param="truncate_prompt_tokens")
    return prompt[-keep:]


def _bad_words(engine: AsyncEngine, body: CompletionRequest | ChatCompletionRequest,
               ) -> list[list[int]]:
    """vLLM's `bad_words` as token sequences: each word as it starts a text and, where
    that differs and is as long, after a space."""
    if not body.bad_words:
        return []
    if engine.tokenizer is None:
        raise APIError(400, "bad_words need the checkpoint's tokenizer", param="bad_words")
    sequences = []
    for word in body.bad_words:
        bare = engine.encode(word.lstrip())
        spaced = engine.encode(" " + word.lstrip())
        sequences.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    return [ids for ids in sequences if ids]


def _supported(body: CompletionRequest | ChatCompletionRequest) -> None:
    try:
        body.check_supported()
    except ProtocolError as error:
        raise APIError(400, str(error), param=error.param) from None


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    """The prompts of a completions request: a string, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


async def _prompt_ids(engine: AsyncEngine, prompts: list[str | list[int]],
                      add_special_tokens: bool) -> list[list[int]]:
    """Each prompt as token ids, text tokenized off the event loop (a megabyte takes most of
    a second)."""
    if not prompts:
        raise APIError(400, "prompt is an empty list; give a string, strings or token ids",
                       param="prompt")
    try:
        return [await asyncio.to_thread(engine.encode, p, add_special_tokens)
                if isinstance(p, str) else list(p) for p in prompts]
    except RequestError as error:
        raise APIError(400, str(error), param="prompt") from None


def _params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
            logprobs: int | None, prompt_logprobs: int | None = None,
            structured: StructuredOutput | None = None,
            bad_words_ids: list[list[int]] | None = None,
            skip_special_tokens: bool | None = None, score_only: bool = False,
            ) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs, structured,
                                    bad_words_ids, skip_special_tokens, score_only)
    except SamplingError as error:
        raise APIError(400, str(error), param=str(error).split("=")[0]) from None


def _api_error(error: BaseException) -> APIError:
    """What a failure while a request was being served tells its client."""
    if isinstance(error, RequestError):
        return APIError(400, str(error))
    if isinstance(error, EngineDead | ServerClosing):
        return APIError(503, str(error), kind="service_unavailable")
    log.error("request failed: %s: %s", type(error).__name__, error)
    return APIError(500, f"internal error: {type(error).__name__}",
                    kind="internal_server_error")


async def _respond(request: Request, engine: AsyncEngine, metrics: ServerMetrics,
                   builder: ResponseBuilder, body: CompletionRequest | ChatCompletionRequest,
                   prompts: list[list[int]], params: list[SamplingParams], want_logprobs: bool,
                   echoes: list[Echo] | None = None, score_only: bool = False) -> Response:
    """Submit one request per prompt and answer with their n completions each, as JSON or
    as Server-Sent Events. `echoes`: the prompts to put in front (completions `echo`);
    `score_only`: drop the one generated token (echo with max_tokens=0)."""
    adapter = body.model if body.model in engine.adapter_names else None
    try:
        request_ids = engine.submit_all(prompts, params, adapter)
    except AdapterError as error:  # unloaded since the request arrived
        raise APIError(404, str(error), param="model", code="model_not_found") from None
    except (RequestError, QueueFull, EngineDead) as error:
        if isinstance(error, QueueFull):
            raise APIError(429, str(error), kind="rate_limit_exceeded") from None
        if isinstance(error, EngineDead):
            raise APIError(503, str(error), kind="service_unavailable") from None
        raise APIError(400, str(error), param="max_tokens" if "max_tokens" in str(error)
                       else "prompt") from None
    if adapter is not None:
        metrics.adapter_requests.labels(metrics.model, adapter).inc(len(request_ids))
    tokenizer = engine.tokenizer
    for echo in echoes or []:  # token-id prompts echo as their decoded (now validated) ids
        if echo.text is None:
            echo.text = tokenizer.decode(echo.token_ids, skip_special_tokens=False) \
                if tokenizer is not None else ""
    n = params[0].n
    prompt_tokens = sum(len(p) for p in prompts)
    streams = [engine.results(r, n) for r in request_ids]
    timer = RequestTimer(metrics)

    def choice_echo(prompt_index: int) -> Echo | None:
        return echoes[prompt_index] if echoes is not None else None

    def visible(prompt_index: int, delta: Any) -> Any:
        """The delta as the client sees it: echo's prompt log-probs kept, and with
        `score_only` its generated token dropped."""
        echo = choice_echo(prompt_index)
        if delta.prompt_logprobs is not None:
            builder.prompt_logprobs[prompt_index] = delta.prompt_logprobs
            if echo is not None:
                echo.logprobs = delta.prompt_logprobs
        if score_only:
            delta.token_ids, delta.text, delta.logprobs = [], "", []
        return delta

    if not body.stream:
        outputs = [CompletionOutput(i) for i in range(len(prompts) * n)]

        async def collect() -> None:
            async for prompt_index, delta in _merge(streams):
                index = prompt_index * n + delta.index
                delta = visible(prompt_index, delta)
                for _ in delta.token_ids:
                    timer.token(index)
                outputs[index].add(delta)

        try:
            finished = await _unless_disconnected(request, collect())
        except Exception as error:
            raise _api_error(error) from None
        if not finished:
            return Response(status_code=499)  # nobody is listening; the requests are aborted
        timer.done()
        choice_echoes = [choice_echo(i // n) for i in range(len(outputs))] if echoes else None
        return JSONResponse(builder.response(outputs, want_logprobs, prompt_tokens,
                                             choice_echoes))

    async def events() -> AsyncIterator[str]:
        completion_tokens, started = 0, set()
        try:
            async for prompt_index, delta in _merge(streams):
                index = prompt_index * n + delta.index
                delta = visible(prompt_index, delta)
                for _ in delta.token_ids:
                    timer.token(index)
                completion_tokens += len(delta.token_ids)
                first = index not in started
                chunk = builder.chunk(index, delta.text, delta.token_ids,
                                      delta.logprobs if want_logprobs else None,
                                      delta.finish_reason, first=first,
                                      echo=choice_echo(prompt_index) if first else None)
                started.add(index)
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as error:
            yield error_event(_api_error(error))
        else:
            timer.done()
            if body.include_usage:
                yield (f"data: {json.dumps(builder.usage_chunk(prompt_tokens, completion_tokens))}"
                       "\n\n")
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _unless_disconnected(request: Request, work: Any) -> bool:
    """Run `work` to its end (True), or cancel it as soon as the client disconnects
    (False); cancelling closes the request's result streams, which aborts them."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # a no-op once it has finished
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()  # re-raises what the work raised
    return True


async def _merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as (which, item); closing this closes them all."""
    if len(streams) == 1:  # no task and queue between a lone stream and its reader
        stream = streams[0]
        try:
            async for item in stream:
                yield 0, item
        finally:
            await stream.aclose()
        return
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
