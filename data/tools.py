"""Tools as code: a Python function is a tool, named by a registered name (`calculator`)
or by `package.module:function`, as rewards are.

Its OpenAI definition (`{"type": "function", "function": {"name", "description",
"parameters"}}`) comes from the signature and the docstring: pydantic turns the
annotations into the parameters' JSON schema (and validates a call's arguments against
them where the tool runs), the docstring's first paragraph is the description and its
Google-style `Args:` section describes each parameter. Running tools, bounded, is
`lathe.data.tool_runner`'s job.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic

from lathe.core.errors import ConfigError

TOOLS = {"calculator": "lathe.data.calculator:calculator"}


@dataclass(frozen=True)
class Tool:
    name: str
    path: str  # module:function, importable where the tool runs
    definition: dict[str, Any]  # OpenAI's {"type": "function", "function": {...}}


def _docstring(function: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The description (first paragraph, one line) and each `Args:` entry's text."""
    doc = inspect.getdoc(function) or ""
    description = " ".join(doc.split("\n\n", 1)[0].split())
    arguments: dict[str, str] = {}
    section = re.search(r"^Args:\n((?:[ \t]+.*\n?|\n)*)", doc, re.MULTILINE)
    current, indent = None, 0
    for line in (section.group(1).splitlines() if section else []):
        entry = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
        depth = len(line) - len(line.lstrip())
        if entry and (current is None or depth <= indent):
            current, indent = entry.group(1), depth
            arguments[current] = entry.group(2).strip()
        elif current is not None and line.strip():
            arguments[current] = f"{arguments[current]} {line.strip()}".strip()
    return description, arguments


def _drop_titles(schema: Any) -> Any:
    """pydantic's schema without the `title` it adds to every property (noise in a
    prompt; OpenAI's own definitions have none)."""
    if isinstance(schema, dict):
        return {k: _drop_titles(v) for k, v in schema.items()
                if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_drop_titles(v) for v in schema]
    return schema


def function_definition(function: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI tool definition of `function` (see the module docstring)."""
    try:
        parameters = pydantic.TypeAdapter(function).json_schema()
    except (pydantic.PydanticUserError, pydantic.errors.PydanticSchemaGenerationError,
            TypeError) as error:
        raise ConfigError(f"tool {name or function.__name__!r}: its parameters have no JSON "
                          f"schema ({error}); annotate them with JSON types") from None
    description, arguments = _docstring(function)
    for key, text in arguments.items():
        if key in parameters.get("properties", {}) and text:
            parameters["properties"][key]["description"] = text
    return {"type": "function", "function": {"name": name or function.__name__,
                                             "description": description,
                                             "parameters": _drop_titles(parameters)}}


def import_function(path: str, what: str) -> Callable[..., Any]:
    """The callable at `package.module:function`; `ConfigError` naming `what` otherwise."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{what} {path!r}: not a package.module:function import path")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"{what} {path!r} cannot be imported: {error}") from None
    if not callable(function):
        raise ConfigError(f"{what} {path!r} is not callable")
    return function


def load_tool(name: str) -> Tool:
    """A registered tool (`calculator`) or `package.module:function`."""
    path = TOOLS.get(name, name)
    if ":" not in path:
        raise ConfigError(f"tool {name!r}: not one of {', '.join(TOOLS)} and not a "
                          "package.module:function import path")
    function = import_function(path, "tool")
    tool_name = name if name in TOOLS else function.__name__
    return Tool(tool_name, path, function_definition(function, tool_name))


def load_tools(names: list[str]) -> list[Tool]:
    """Several tools; two of one name is a `ConfigError`."""
    tools = [load_tool(name) for name in names]
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ConfigError(f"tools: two tools are named {tool.name!r}; a call could not "
                              "say which it means")
        seen.add(tool.name)
    return tools
