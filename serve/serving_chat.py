"""`POST /v1/chat/completions`: the chat rendered through the served template (in a
bounded worker, checked to show the tools it is given), the reply's reasoning and tool calls
parsed as it streams (`lathe.serve.replies`), a forced tool call constrained by its grammar;
the rest is the completions route's plumbing (`lathe.serve.serving_completions`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from lathe.data.chat_template import CHECK_TOOLS, ChatTemplateError
from lathe.serve.protocol import (
    ChatCompletionRequest,
    ChatRendering,
    ProtocolError,
    ResponseBuilder,
    ResponseOptions,
)
from lathe.serve.replies import ReplyFormat
from lathe.serve.request_checks import RequestError
from lathe.serve.serving import APIError, Serving, authorize, serving
from lathe.serve.serving_completions import (
    bad_words_ids,
    check_supported,
    respond,
    sampling_params,
    structured_of,
    truncated,
)

router = APIRouter(dependencies=[Depends(authorize)])


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    ctx = serving(request)
    check_supported(body)
    engine = ctx.ready(body.model)
    render = chat_renderer(ctx, request, body)
    try:
        plan = body.tool_plan(ctx.tool_parser, ctx.literals, ctx.config.max_tool_calls)
    except ProtocolError as error:
        raise APIError(400, str(error), param=error.param) from None
    asked = structured_of(body, ctx.literals)
    if plan is not None and plan.structured is not None:
        if asked is not None:
            raise APIError(400, f"tool_choice forces a tool call, which {asked[0]} "
                                "cannot constrain as well; send one of them",
                           param=asked[0])
        asked = ("tool_choice", plan.structured)
    tools = plan.tools if plan is not None else None
    try:
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(ctx.renders, render, tools)
        if tools and not await loop.run_in_executor(ctx.renders, _shows_tools, render,
                                                    text):
            raise APIError(400, "this checkpoint's chat template does not render tools, "
                                "so the model would never see them; serve it with a "
                                "template that does (--chat-template)", param="tools")
    except ChatTemplateError as error:
        if tools is None and await asyncio.get_running_loop().run_in_executor(
                ctx.renders, _renders_with_tools, render):
            raise APIError(400, f"this chat template needs tools to render ({error}); "
                                "send tools, or serve another template (--chat-template)",
                           param="messages") from None
        raise APIError(400, str(error), param="messages") from None
    try:
        prompt = truncated(engine, await asyncio.to_thread(
            engine.encode, text, body.add_special_tokens), body.truncate_prompt_tokens)
    except RequestError as error:
        raise APIError(400, str(error), param="messages") from None
    max_tokens = body.completion_budget
    if max_tokens is None:
        max_tokens = max(engine.max_model_len - len(prompt), 1)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    reasoning = ctx.reasoning
    reply = ReplyFormat(reasoning, reasoning is not None and reasoning.starts_inside(text),
                        plan.parser if plan is not None else None,
                        plan is not None and plan.named, plan is None or plan.parallel)
    if asked is not None and reasoning is not None:
        field, spec = asked
        asked = field, dataclasses.replace(spec, prefix=reasoning.constraint_prefix(
            reply.starts_inside, ctx.literals, engine.info.eos_token_ids))
    structured = await ctx.compile_structured(engine, asked)
    # the parsers read markers that may be special tokens (Mistral's [TOOL_CALLS])
    keep_markers = reply.tools is not None or reply.reasoning is not None
    params = sampling_params(body, max_tokens, logprobs, body.prompt_logprobs, structured,
                     bad_words_ids(engine, body), False if keep_markers else None,
                     defaults=ctx.sampling_defaults)
    builder = ResponseBuilder("chat", ctx.name, engine.tokenizer, ResponseOptions(
        [prompt], params.n, body.return_token_ids, body.prompt_logprobs is not None,
        reply, body.include_reasoning, body.request_id))
    return await respond(request, engine, ctx.metrics, builder, body, [prompt], [params],
                          bool(body.logprobs))


Render = Callable[[list[dict[str, Any]] | None], str]


def chat_renderer(ctx: Serving, request: Request, body: ChatRendering) -> Render:
    """`body`'s chat as the served template renders it (the request's own template where
    the server trusts them), given the tools to show; run it on `ctx.renders`, whose
    template workers bound its time and memory. A 400 for a chat that cannot be rendered."""
    if ctx.template is None:
        raise APIError(400, ctx.no_template)
    if body.chat_template is not None and not ctx.config.trust_request_chat_template:
        raise APIError(400, "chat_template: this server renders its own chat template "
                            "only; start it with --trust-request-chat-template to take "
                            "templates from requests", param="chat_template")
    try:
        messages = body.chat()
    except ProtocolError as error:
        raise APIError(400, str(error), param="messages") from None
    kwargs = {**body.template_kwargs(), "template": body.chat_template,
              "continue_final_message": body.continue_final_message}
    client = request.client.host if request.client else ""
    template = ctx.template

    def render(with_tools: list[dict[str, Any]] | None) -> str:
        return template.render(messages, body.add_generation_prompt, with_tools,
                               body.documents, client=client, **kwargs)
    return render


def _renders_with_tools(render: Render) -> bool:
    try:
        render(CHECK_TOOLS)
    except ChatTemplateError:
        return False
    return True


def _shows_tools(render: Render, text: str) -> bool:
    """Whether `text`, rendered with tools, differs from the chat rendered without them
    (a template that fails without tools surely shows them)."""
    try:
        return render(None) != text
    except ChatTemplateError:
        return True
