"""Typed configs from YAML recipes: every stage's config is a dataclass loaded here.

A recipe is a YAML mapping whose keys are the dataclass's fields (nested dataclasses
are nested mappings). Command-line overrides use dotted paths, `--optim.lr=3e-4` or
`--optim.lr 3e-4`, with values parsed as YAML scalars. Unknown keys and values of the
wrong type raise one `ConfigError` naming the dotted field, the value and what fits.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml

from lathe.core.errors import ConfigError

T = TypeVar("T")


def load_config(cls: type[T], path: str | Path | None = None,
                overrides: Sequence[str] = ()) -> T:
    """Build `cls` from a YAML recipe (or its defaults when `path` is None) plus overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"recipe {str(path)!r} does not exist; pass --config with a YAML file")
        loaded = yaml.safe_load(path.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"recipe {str(path)!r} must be a YAML mapping of field: value")
        data = loaded or {}
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value)
    return from_dict(cls, data)


def parse_overrides(args: Sequence[str]) -> list[tuple[str, Any]]:
    """`["--a.b=1", "--c", "x"]` -> `[("a.b", 1), ("c", "x")]`, values parsed as YAML scalars."""
    pairs: list[tuple[str, Any]] = []
    args = list(args)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"unexpected argument {arg!r}; overrides look like --section.field=value")
        key, sep, raw = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value; write --{key}=VALUE")
            raw = args[i + 1]
            i += 1
        pairs.append((key, yaml.safe_load(raw) if raw != "" else ""))
        i += 1
    return pairs


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Instantiate dataclass `cls` from plain data, checking every key and type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or cls.__name__} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown field(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid fields of {prefix or cls.__name__}: {', '.join(sorted(fields))}"
        )
    kwargs = {name: _coerce(hints[name], value, prefix + name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field with no default was not given
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None


def to_dict(config: Any) -> dict[str, Any]:
    """The plain-data form of a config dataclass (for YAML, JSON, W&B and provenance)."""
    return dataclasses.asdict(config)


def _coerce(hint: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(option, value, name)
            except ConfigError as e:
                errors.append((option, str(e)))
        shaped = [message for option, message in errors if _same_kind(option, value)]
        if len(errors) == 1 or len(shaped) == 1:  # the one option the value was meant as
            raise ConfigError(errors[0][1] if len(errors) == 1 else shaped[0])
        raise ConfigError(f"{name}={value!r} fits none of {hint}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{name}={value!r} must be one of {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(hint):
        return value if isinstance(value, hint) else from_dict(hint, value, prefix=name + ".")
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}={value!r} must be a list")
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or hint is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}={value!r} must be a mapping")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # PyYAML (YAML 1.1) reads 5e-4 as a string: it wants 5.0e-4
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool):
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ConfigError(
                f"{name}={value!r} must be of type {hint.__name__} (got {type(value).__name__})"
            )
        return value
    raise ConfigError(f"{name}: unsupported config type {hint}")


def _same_kind(hint: Any, value: Any) -> bool:
    """Whether `value` is the kind of thing `hint` is (a list for a list, a mapping for a
    dataclass or dict, a scalar for a scalar), before its contents are checked."""
    origin = typing.get_origin(hint) or hint
    if origin in (list, tuple, Sequence):
        return isinstance(value, (list, tuple))
    if dataclasses.is_dataclass(hint) or origin is dict:
        return isinstance(value, dict)
    return not isinstance(value, (list, tuple, dict))


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override --{key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value
