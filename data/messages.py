"""Chat messages and tool lists in OpenAI's chat format, checked and put in the form chat
templates read: the one validator for training records and requests alike.

A message is `{"role", "content"}` plus, by role:
- assistant: `tool_calls` (`[{"type": "function", "id"?, "function": {"name", "arguments"}}]`,
  the arguments a JSON object or its JSON text; content may then be null or absent) and
  reasoning (`reasoning_content`, or `reasoning` / `thinking`);
- tool: `tool_call_id` and `name`, both optional.

Content is a string or a list of text parts (`{"type": "text", "text"}`), joined. Tool-call
arguments given as JSON text are parsed into the object templates expect (`tojson` of a
string would quote it twice), as vLLM does before rendering. Anything else is a
`MessageError` whose text names the field and the fix.
"""

from __future__ import annotations

import json
from typing import Any

from lathe.data.chat_template import REASONING_FIELDS

ROLES = ("system", "user", "assistant", "tool")
_FIELDS = {"system": ("name",), "user": ("name",), "tool": ("tool_call_id", "name"),
           "assistant": ("name", "tool_calls", *REASONING_FIELDS)}

Message = dict[str, Any]


class MessageError(ValueError):
    """One field of a message or tool list is malformed; the text names it."""


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise MessageError(f"{where} must be a string or a list of text parts, got "
                           f"{type(value).__name__}")
    parts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise MessageError(f"{where}[{j}]: parts of type {kind!r} are not supported; "
                               "give text parts ({\"type\": \"text\", \"text\": ...})")
        if not isinstance(part.get("text"), str):
            raise MessageError(f"{where}[{j}].text must be a string")
        parts.append(part["text"])
    return "".join(parts)


def _tool_call(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("function"), dict):
        raise MessageError(f"{where} must be {{\"type\": \"function\", \"function\": "
                           "{\"name\", \"arguments\"}}")
    if value.get("type", "function") != "function":
        raise MessageError(f"{where}.type is {value['type']!r}; only \"function\" calls exist")
    function = value["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise MessageError(f"{where}.function.name must be a non-empty string")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError) as error:
            reason = str(error) or "nested too deeply"
            raise MessageError(f"{where}.function.arguments is not JSON ({reason}); give a "
                               "JSON object or its text") from None
    if not isinstance(arguments, dict):
        raise MessageError(f"{where}.function.arguments must be a JSON object, got "
                           f"{type(arguments).__name__}")
    call: dict[str, Any] = {"type": "function",
                            "function": {"name": function["name"], "arguments": arguments}}
    if value.get("id") is not None:
        if not isinstance(value["id"], str):
            raise MessageError(f"{where}.id must be a string")
        call["id"] = value["id"]
    return call


def normalize_message(value: Any, where: str) -> Message:
    """One message checked and normalized (see the module docstring); `where` names it
    in errors, e.g. "messages[2]"."""
    if not isinstance(value, dict):
        raise MessageError(f"{where} must be an object with role and content")
    role = value.get("role")
    if role not in ROLES:
        raise MessageError(f"{where}.role is {role!r}; use one of {', '.join(ROLES)}")
    allowed = ("role", "content", *_FIELDS[role])
    for key in value:
        if key not in allowed:
            raise MessageError(f"{where}.{key} is not a field of a {role} message; its fields "
                               f"are {', '.join(allowed)}")
    message: Message = {"role": role}
    calls = value.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not calls:
            raise MessageError(f"{where}.tool_calls must be a non-empty list")
        message["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{i}]")
                                 for i, c in enumerate(calls)]
    content = value.get("content")
    if content is None and not calls:
        raise MessageError(f"{where}.content is required (a string or text parts)")
    if content is not None:
        message["content"] = _text(content, f"{where}.content")
    for key in (*REASONING_FIELDS, "name", "tool_call_id"):
        if value.get(key) is not None:
            if not isinstance(value[key], str):
                raise MessageError(f"{where}.{key} must be a string")
            message[key] = value[key]
    return message


def normalize_messages(value: Any, where: str) -> list[Message]:
    """A non-empty message list (or a string: one user message), each message normalized."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise MessageError(f"{where} must be a string or a non-empty list of messages")
    return [normalize_message(m, f"{where}[{i}]") for i, m in enumerate(value)]


def normalize_tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """OpenAI's tool list (`[{"type": "function", "function": {"name", "description"?,
    "parameters"?}}]`), checked; None when absent."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise MessageError(f"{where} must be a list of tools")
    for i, tool in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise MessageError(f"{at} must be {{\"type\": \"function\", \"function\": "
                               "{\"name\", \"description\", \"parameters\"}}")
        function = tool["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise MessageError(f"{at}.function.name must be a non-empty string")
        if not isinstance(function.get("parameters", {}), dict):
            raise MessageError(f"{at}.function.parameters must be a JSON schema object")
    return value
