"""`POST /v1/responses`: OpenAI's Responses API (as an agent SDK or a Codex-style client
calls it, stateless or continuing a stored response). The request's instructions and
input items become a chat — messages, `function_call` items as the assistant's tool
calls, `function_call_output` items as tool messages, `reasoning` items as the next
assistant turn's reasoning — which the chat route answers (`lathe.serve.serving_chat`:
the served template, the tool-call and reasoning parsers, forced calls, structured
outputs); its reply comes back as a Response whose output items are the reasoning, the
message and each function call, or streamed as the Responses events (`response.created`
... `response.completed`).

A response is stored unless the request says `store: false` (or the server keeps none,
`--responses-store 0`): `previous_response_id` continues it — the chain's input and output
items come before the request's input, its instructions do not carry over — GET /
DELETE /v1/responses/{id} read and remove it (`lathe.serve.response_store`), and GET
/v1/responses/{id}/input_items lists the request's own items, each with an id. `background`
is refused with the reason. Only function tools are served, and only text comes in and
goes out. vLLM's sampling extensions (`seed`, `top_k`,
`structured_outputs`, `chat_template_kwargs`, ...) pass through to the chat route.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, ValidationError

from lathe.serve.protocol import ChatCompletionRequest, RequestBody, bounded
from lathe.serve.response_store import MissingResponse, ResponseStore, StoredResponse
from lathe.serve.serving import APIError, authorize, serving
from lathe.serve.serving_chat import chat_completions

router = APIRouter(dependencies=[Depends(authorize)])

TEXT_PARTS = ("input_text", "output_text", "text")
# vLLM's sampling extensions a request may add (`extra_body`), passed to the chat route,
# which checks them as its own
PASSED = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "stop", "ignore_eos", "structured_outputs", "logit_bias",
          "chat_template_kwargs")
# Responses fields taken with the value that means "not used", and why anything else is not
UNUSED = {
    "background": ((None, False), "this server answers in the foreground only"),
    "truncation": ((None, "disabled"), "this server does not truncate a conversation; "
                                       "trim the input"),
    # reasoning items carry their text, so nothing is encrypted to send back
    "include": ((None, [], ["reasoning.encrypted_content"]),
                "this server returns no extra output data"),
    "top_logprobs": ((None, 0), "this server returns no log-probabilities here; use "
                                "/v1/chat/completions"),
    "service_tier": ((None, "auto", "default"), "this server has one tier"),
}


class ResponsesRequest(RequestBody):
    model_config = ConfigDict(extra="allow")  # `PASSED` alone

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: bounded(int, "max_tokens") | None = None
    temperature: bounded(float, "temperature") | None = None
    top_p: bounded(float, "top_p") | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None  # `user`'s newer name
    prompt_cache_key: str | None = None  # a routing hint: the prefix cache needs none
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None


def _refuse(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(f"{where}.content must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _refuse(f"{where}.content[{j}]: type={kind!r} is not served; this model "
                          f"reads text ({', '.join(TEXT_PARTS)} parts)", where)
        texts.append(part["text"])
    return "".join(texts)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": body.input}] \
        if isinstance(body.input, str) else body.input


ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                 "reasoning": "rs"}


def listed_items(items: list[dict[str, Any]], response_id: str) -> list[dict[str, Any]]:
    """A request's input items as OpenAI lists them back: each with an id (the client's,
    or one of its own) and a message's text as a content part."""
    listed = []
    suffix = response_id.removeprefix("resp_")
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        given = item.get("id")
        item = {**item, "type": kind, "id": given if isinstance(given, str) and given
                else f"{ITEM_PREFIXES.get(kind, 'item')}_{suffix}_in{index}"}
        if kind == "message":
            item.setdefault("status", "completed")
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"],
                                    **({"annotations": []} if part == "output_text" else {})}]
        listed.append(item)
    return listed


def chat_messages(instructions: str | None, items: list[dict[str, Any]], first: int = 0
                  ) -> list[dict[str, Any]]:
    """The chat the instructions and the conversation's items make (`first`: the index
    the request's own input starts from, after the stored items it continues)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    reasoning = None  # a reasoning item's text, for the assistant turn it precedes
    for i, item in enumerate(items, -first):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _refuse(f"{where}.role={role!r} is not one of user, assistant, system, "
                              "developer", where)
            message = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"type": "function", "id": item.get("call_id"), "function": {
                "name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call],
                                 **({"reasoning_content": reasoning} if reasoning else {})})
                reasoning = None
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(output, where)})
        elif kind == "reasoning":
            parts = [part for key in ("content", "summary")
                     if isinstance(item.get(key), list) for part in item[key]]
            reasoning = "".join(part["text"] for part in parts
                                if isinstance(part, dict) and isinstance(part.get("text"), str))
        else:
            raise _refuse(f"{where}.type={kind!r} is not served (message, function_call, "
                          "function_call_output and reasoning items are)", where)
    return messages


def chat_request(body: ResponsesRequest, context: list[dict[str, Any]]
                 ) -> ChatCompletionRequest:
    """The chat completion the Responses request asks for: its input after `context`, the
    stored items it continues."""
    extra = body.model_extra or {}
    for name in extra:
        if name not in PASSED:
            shown = name.encode("ascii", "backslashreplace").decode()
            raise _refuse(f"unknown parameter `{shown}`: this server does not support it; "
                          "remove it", shown)
    for name, (allowed, reason) in UNUSED.items():
        value = getattr(body, name)
        if value not in allowed:
            raise _refuse(f"{name}: {reason}", name)
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise _refuse(f"tools[{i}].type={tool.get('type')!r}: only function tools are "
                          "served", "tools")
        tools.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict")
            if key in tool}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise _refuse(f"tool_choice type={choice.get('type')!r}: only none, auto, "
                          "required or a function are served", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body.instructions, context + input_items(body), len(context)),
        "tools": tools or None,
        "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "stream": body.stream,
        "stream_options": {"include_usage": True} if body.stream else None,
        "response_format": _response_format(body.text),
        "reasoning_effort": (body.reasoning or {}).get("effort"), **extra}
    try:
        return ChatCompletionRequest.model_validate(
            {key: value for key, value in fields.items() if value is not None})
    except ValidationError as error:
        raise RequestValidationError(error.errors()) from None


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat route's response_format."""
    spec = (text or {}).get("format")
    if spec is not None and not isinstance(spec, dict):
        raise _refuse("text.format must be an object with a type", "text")
    if spec is None or spec.get("type") == "text":
        return None
    if spec.get("type") == "json_object":
        return {"type": "json_object"}
    if spec.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            key: spec[key] for key in ("name", "schema", "strict", "description")
            if key in spec}}
    raise _refuse(f"text.format.type={spec.get('type')!r} is not one of text, json_object, "
                  "json_schema", "text")


class Shell:
    """The Response object's fields that do not depend on the reply."""

    def __init__(self, body: ResponsesRequest, stored: bool) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.fields = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "model": body.model, "instructions": body.instructions,
            "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature,
            "top_p": body.top_p, "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning, "metadata": body.metadata or {}, "user": body.user,
            "store": stored, "truncation": "disabled",
            "previous_response_id": body.previous_response_id,
            "error": None}

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self.fields, "status": status, "incomplete_details": incomplete,
                "output": output, "usage": usage}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    details = usage.get("completion_tokens_details") or {}
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": usage["prompt_tokens_details"],
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"]}


def _status(finish_reason: str | None) -> Literal["completed", "incomplete"]:
    return "incomplete" if finish_reason == "length" else "completed"


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_of(shell: Shell, chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's reply as the Response."""
    choice = chat["choices"][0]
    message, output = choice["message"], []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(f"rs_{shell.id[5:]}", message["reasoning_content"]))
    if message.get("content"):
        output.append(_message_item(f"msg_{shell.id[5:]}", message["content"]))
    for i, call in enumerate(message.get("tool_calls") or []):
        output.append(_call_item(f"fc_{shell.id[5:]}_{i}", call["id"],
                                 call["function"]["name"], call["function"]["arguments"]))
    return shell.response(_status(choice.get("finish_reason")), output,
                          _usage(chat.get("usage")))


class EventStream:
    """A chat completion's chunks as the Responses events: an output item opens at its first
    delta (reasoning, message text, or a function call), every item closes at the end in
    the order it opened, and the Response completes with them all and the usage."""

    def __init__(self, shell: Shell) -> None:
        self.shell, self.sequence = shell, 0
        self.items: list[dict[str, Any]] = []  # open items, in output order
        self.by_key: dict[Any, int] = {}  # "reasoning", "message", ("call", index) -> item
        # each item's text (reasoning, message) or arguments as its deltas, joined at the end
        self.texts: dict[int, list[str]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.response: dict[str, Any] | None = None  # the whole Response, once finished

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def start(self) -> list[str]:
        response = self.shell.response("in_progress", [], None)
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def _open(self, key: Any, item: dict[str, Any]) -> tuple[int, list[str]]:
        index = self.by_key.get(key)
        if index is not None:
            return index, []
        index = self.by_key[key] = len(self.items)
        self.items.append(item)
        events = [self.event("response.output_item.added", output_index=index, item=item)]
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=index, content_index=0,
                                     part={"type": "output_text", "text": "",
                                           "annotations": [], "logprobs": []}))
        return index, events

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[str] = []
        suffix = self.shell.id[5:]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                index, opened = self._open("reasoning", _reasoning_item(f"rs_{suffix}", "",
                                                                        "in_progress"))
                item = self.items[index]
                self.texts.setdefault(index, []).append(delta["reasoning_content"])
                events += opened + [self.event(
                    "response.reasoning_text.delta", item_id=item["id"], output_index=index,
                    content_index=0, delta=delta["reasoning_content"])]
            if delta.get("content"):
                index, opened = self._open("message", {
                    **_message_item(f"msg_{suffix}", "", "in_progress"), "content": []})
                item = self.items[index]
                self.texts.setdefault(index, []).append(delta["content"])
                events += opened + [self.event(
                    "response.output_text.delta", item_id=item["id"], output_index=index,
                    content_index=0, delta=delta["content"], logprobs=[])]
            for call in delta.get("tool_calls") or []:
                key = ("call", call.get("index", 0))
                function = call.get("function") or {}
                index, opened = self._open(key, _call_item(
                    f"fc_{suffix}_{key[1]}", call.get("id") or "", function.get("name") or "",
                    "", "in_progress"))
                item = self.items[index]
                events += opened
                if function.get("arguments"):
                    self.texts.setdefault(index, []).append(function["arguments"])
                    events.append(self.event(
                        "response.function_call_arguments.delta", item_id=item["id"],
                        output_index=index, delta=function["arguments"]))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[str]:
        events, output = [], []
        for index, item in enumerate(self.items):
            text = "".join(self.texts.get(index, []))
            if item["type"] == "reasoning":
                events.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                         output_index=index, content_index=0, text=text))
                done = _reasoning_item(item["id"], text)
            elif item["type"] == "message":
                done = _message_item(item["id"], text)
                part = done["content"][0]
                events += [self.event("response.output_text.done", item_id=item["id"],
                                      output_index=index, content_index=0, text=text,
                                      logprobs=[]),
                           self.event("response.content_part.done", item_id=item["id"],
                                      output_index=index, content_index=0, part=part)]
            else:
                done = {**item, "arguments": text, "status": "completed"}
                events.append(self.event("response.function_call_arguments.done",
                                         item_id=item["id"], output_index=index,
                                         arguments=text))
            events.append(self.event("response.output_item.done", output_index=index,
                                     item=done))
            output.append(done)
        status = _status(self.finish_reason)
        self.response = self.shell.response(status, output, _usage(self.usage))
        return events + [self.event(f"response.{status}", response=self.response)]


def _conversation(store: ResponseStore | None, previous_id: str | None
                  ) -> list[dict[str, Any]]:
    """The stored items a request continues (none without `previous_response_id`)."""
    if previous_id is None:
        return []
    if store is None:
        raise _refuse("previous_response_id: this server keeps no responses "
                      "(--responses-store 0); send the whole conversation as input",
                      "previous_response_id")
    try:
        return store.conversation(previous_id)
    except MissingResponse as missing:
        raise APIError(404, f"previous_response_id: no response with id "
                       f"'{missing.response_id}' is stored here (never stored, deleted, or "
                       "dropped as the oldest); send the whole conversation as input",
                       param="previous_response_id") from None


def _stored(request: Request, response_id: str) -> StoredResponse:
    store = serving(request).responses
    entry = store.get(response_id) if store is not None else None
    if entry is None:
        raise APIError(404, f"no response with id '{response_id}' is stored here",
                       param="response_id")
    return entry


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse(_stored(request, response_id).response)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, limit: str = "20",
                           order: str = "desc", after: str | None = None) -> JSONResponse:
    """The response's input items, newest first unless `order` is asc, `limit` a page
    (1 to 100) after the item `after`, as OpenAI's list."""
    if not (limit.isdigit() and 1 <= int(limit) <= 100):
        raise _refuse(f"limit={limit!r} must be a whole number from 1 to 100", "limit")
    if order not in ("asc", "desc"):
        raise _refuse(f"order={order!r} is not asc or desc", "order")
    items = _stored(request, response_id).input_items
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise _refuse(f"after={after!r} is not an input item of {response_id}", "after")
        start = ids.index(after) + 1
    page = ordered[start:start + int(limit)]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": start + int(limit) < len(ordered)})


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request) -> JSONResponse:
    _stored(request, response_id)
    serving(request).responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    store = serving(request).responses
    items = input_items(body)
    chat_body = chat_request(body, _conversation(store, body.previous_response_id))
    keep = store is not None and body.store is not False
    shell = Shell(body, stored=keep)

    def kept(response: dict[str, Any]) -> dict[str, Any]:
        if keep:
            store.put(response, listed_items(items, response["id"]),
                      body.previous_response_id)
        return response

    answer = await chat_completions(chat_body, request)
    if isinstance(answer, JSONResponse):
        return JSONResponse(kept(response_of(shell, json.loads(answer.body))))
    if not isinstance(answer, StreamingResponse):
        return answer  # the client left
    chunks = answer.body_iterator

    async def events() -> AsyncIterator[str]:
        stream = EventStream(shell)
        for event in stream.start():
            yield event
        try:
            async for raw in chunks:
                text = raw if isinstance(raw, str) else raw.decode()
                for line in text.splitlines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:  # the reply failed after the stream opened
                        yield stream.event("error", **{key: chunk["error"].get(key)
                                                       for key in ("message", "code", "param")})
                        return
                    for event in stream.chunk(chunk):
                        yield event
        finally:  # the client gone: the chat's stream aborts its requests now
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
        finished = stream.finish()
        kept(stream.response)
        for event in finished:
            yield event
    return StreamingResponse(events(), media_type="text/event-stream")
