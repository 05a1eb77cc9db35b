"""`POST /v1/completions`, and the request plumbing both generation routes share
(`lathe.serve.serving_chat` is the other): sampling parameters from the body, prompts
tokenized off the event loop, every prompt submitted at once, and the answer as JSON or
Server-Sent Events — a client that disconnects aborts its requests."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lathe.serve.async_engine import EngineDead, QueueFull, ServerClosing
from lathe.serve.engine_pool import Engine
from lathe.serve.metrics import RequestTimer, ServerMetrics
from lathe.serve.outputs import CompletionOutput
from lathe.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Echo,
    ProtocolError,
    ResponseBuilder,
    ResponseOptions,
)
from lathe.serve.request_checks import AdapterError, RequestError
from lathe.serve.sampling_defaults import SamplingDefaults
from lathe.serve.sampling_params import SamplingError, SamplingParams
from lathe.serve.serving import APIError, authorize, error_event, serving
from lathe.serve.structured import Literals, StructuredOutput

log = logging.getLogger("lathe.serve")

router = APIRouter(dependencies=[Depends(authorize)])


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    ctx = serving(request)
    check_supported(body)
    engine = ctx.ready(body.model)
    structured = await ctx.compile_structured(engine, structured_of(body, ctx.literals))
    given = _prompt_list(body.prompt)
    prompts = [truncated(engine, p, body.truncate_prompt_tokens)
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

    bad_words = bad_words_ids(engine, body)
    params = [sampling_params(body, budget(p), logprobs, prompt_logprobs, structured, bad_words,
                      score_only=score_only, defaults=ctx.sampling_defaults) for p in prompts]
    echoes = [Echo(g if isinstance(g, str) and not body.truncate_prompt_tokens else None,
                   ids) for g, ids in zip(given, prompts, strict=True)] \
        if body.echo else None
    builder = ResponseBuilder("completion", ctx.name, engine.tokenizer, ResponseOptions(
        prompts, params[0].n, body.return_token_ids, body.prompt_logprobs is not None,
        request_id=body.request_id))
    return await respond(request, engine, ctx.metrics, builder, body, prompts, params,
                          logprobs is not None, echoes, score_only)


def structured_of(body: CompletionRequest | ChatCompletionRequest,
                literals: Literals) -> tuple[str, StructuredOutput] | None:
    try:
        return body.structured_output(literals)
    except ProtocolError as error:
        raise APIError(400, str(error), param=error.param) from None


def truncated(engine: Engine, prompt: list[int], keep: int | None) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as
    the context window holds)."""
    if keep is None:
        return prompt
    keep = engine.max_model_len if keep == -1 else keep
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens=0 would leave no prompt; give at least 1 "
                            "(or -1 for the context window)", param="truncate_prompt_tokens")
    return prompt[-keep:]


def bad_words_ids(engine: Engine, body: CompletionRequest | ChatCompletionRequest,
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


def check_supported(body: CompletionRequest | ChatCompletionRequest) -> None:
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


async def _prompt_ids(engine: Engine, prompts: list[str | list[int]],
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


def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
            logprobs: int | None, prompt_logprobs: int | None = None,
            structured: StructuredOutput | None = None,
            bad_words_ids: list[list[int]] | None = None,
            skip_special_tokens: bool | None = None, score_only: bool = False,
            defaults: SamplingDefaults | None = None) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs, prompt_logprobs, structured,
                                    bad_words_ids, skip_special_tokens, score_only, defaults)
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


async def respond(request: Request, engine: Engine, metrics: ServerMetrics,
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

    cached: dict[int, int] = {}  # prompt -> its tokens the prefix cache held (first sample's)

    def visible(prompt_index: int, delta: Any) -> Any:
        """The delta as the client sees it: echo's prompt log-probs kept, and with
        `score_only` its generated token dropped; its prompt's cached tokens counted."""
        if delta.index == 0:
            cached.setdefault(prompt_index, delta.num_cached_tokens)
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
                                             sum(cached.values()), choice_echoes))

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
                counted = builder.usage_chunk(prompt_tokens, completion_tokens,
                                              sum(cached.values()))
                yield f"data: {json.dumps(counted)}\n\n"
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
