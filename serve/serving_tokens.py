"""`POST /tokenize` and `POST /detokenize` (vLLM's): a prompt — or a chat, rendered through
the served template as `/v1/chat/completions` renders it — as the token ids the model would
be given, with their count and the context they must fit; and token ids back to text. What
a client needs to budget a conversation against the served model's own template."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request

from lathe.data.chat_template import ChatTemplateError
from lathe.data.messages import MessageError, normalize_tools
from lathe.serve.engine_pool import Engine
from lathe.serve.protocol import (
    DetokenizeRequest,
    ProtocolError,
    TokenizeChatRequest,
    TokenizeRequest,
)
from lathe.serve.serving import APIError, authorize, serving
from lathe.serve.serving_chat import chat_renderer

router = APIRouter(dependencies=[Depends(authorize)])


def ready_with_tokenizer(request: Request, model: str | None) -> Engine:
    engine = serving(request).ready(model)
    if engine.tokenizer is None:
        raise APIError(400, "this checkpoint has no tokenizer.json: there is nothing to "
                            "tokenize with")
    return engine


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    ctx = serving(request)
    engine = ready_with_tokenizer(request, body.model)
    if isinstance(body, TokenizeChatRequest):
        try:
            body.check_rendering()
        except ProtocolError as error:
            raise APIError(400, str(error), param=error.param) from None
        try:
            tools = normalize_tools(body.tools, "tools") if body.tools else None
        except MessageError as error:
            raise APIError(400, str(error), param="tools") from None
        render = chat_renderer(ctx, request, body)
        try:
            text = await asyncio.get_running_loop().run_in_executor(ctx.renders, render, tools)
        except ChatTemplateError as error:
            raise APIError(400, str(error), param="messages") from None
    else:
        text = body.prompt
    ids = await asyncio.to_thread(engine.encode, text, body.add_special_tokens)
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": [engine.tokenizer.id_to_token(i) for i in ids]
            if body.return_token_strs else None}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    engine = ready_with_tokenizer(request, body.model)
    vocab = engine.tokenizer.get_vocab_size(with_added_tokens=True)
    outside = [token for token in body.tokens if token >= vocab]
    if outside:
        raise APIError(400, f"tokens: {outside[0]} is outside the vocabulary (ids 0 to "
                            f"{vocab - 1})", param="tokens")
    return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, body.tokens,
                                              skip_special_tokens=False)}
