"""Typed configs from YAML recipes: every stage's config is a dataclass loaded here.

A recipe is a YAML mapping whose keys are the dataclass's fields (nested dataclasses
are nested mappings). Command-line overrides use dotted paths, `--optim.lr=3e-4` or
`--optim.lr 3e-4`, with values parsed as YAML scalars. Unknown keys and values of the
wrong type raise one `ConfigError` naming the dotted field, the value and what fits.

A command with flags of its own (`lathe serve`) generates them from its config dataclass
instead (`add_config_flags`, `config_from_flags`): one flag per field, nested sections
flattened, the help and any other spelling in each field's `cli(...)` metadata, defaults
and checks read from the dataclasses alone, and a `--config` YAML file beneath the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from collections.abc import Iterator, Sequence
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


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "", base: T | None = None) -> T:
    """Instantiate dataclass `cls` from plain data, checking every key and type. Fields
    the data leaves out keep `base`'s values when given, else the defaults — a nested
    section's default being its parent's (a `default_factory` may differ from the section
    class's own defaults)."""
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
    kwargs = {name: _coerce(hints[name], value, prefix + name,
                            getattr(base, name) if base is not None else _default(fields[name]))
              for name, value in data.items()}
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except TypeError as e:  # a required field with no default was not given
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None


def to_dict(config: Any) -> dict[str, Any]:
    """The plain-data form of a config dataclass (for YAML, JSON, W&B and provenance)."""
    return dataclasses.asdict(config)


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _coerce(hint: Any, value: Any, name: str, default: Any = None) -> Any:
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
                return _coerce(option, value, name, default)
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
        if isinstance(value, hint):
            return value
        return from_dict(hint, value, prefix=name + ".",
                         base=default if isinstance(default, hint) else None)
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}={value!r} must be a list")
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or hint is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}={value!r} must be a mapping")
        item = args[1] if args else Any
        return {key: _coerce(item, v, f"{name}[{key!r}]") for key, v in value.items()}
    if hint is Path:
        if not isinstance(value, (str, Path)) or str(value) == "":
            raise ConfigError(f"{name}={value!r} must be a path")
        return Path(value)
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


def cli(help: str, *, flag: str | None = None, negate: str | None = None,
        env: str | None = None, choices: Sequence[str] | None = None,
        metavar: str | None = None, positional: bool = False,
        show_default: bool = True) -> dict[str, Any]:
    """A field's command-line spelling, as `dataclasses.field(metadata=cli(...))`: its help,
    and where the default spelling (`--field-name`) does not fit: another `flag` name; for
    a boolean that is on by default, the `negate` flag that turns it off; an environment
    variable read when neither the flags nor the file set the field; `choices` beyond what
    its type says; a positional argument; whether --help shows the default."""
    return {"cli": {"help": help, "flag": flag, "negate": negate, "env": env,
                    "choices": choices, "metavar": metavar, "positional": positional,
                    "show_default": show_default}}


@dataclasses.dataclass(frozen=True)
class _Flag:
    path: tuple[str, ...]  # the field's dotted path from the top config
    hint: Any  # its type, Optional unwrapped
    default: Any
    spec: dict[str, Any]  # its cli(...) metadata

    @property
    def dest(self) -> str:
        return "config__" + "__".join(self.path)

    @property
    def name(self) -> str:
        if self.spec["positional"]:
            return self.path[-1]
        if self.hint is bool and self.default is True:
            return self.spec["negate"] or "--no-" + self.path[-1].replace("_", "-")
        return self.spec["flag"] or "--" + self.path[-1].replace("_", "-")


def _optional(hint: Any) -> Any:
    """`X | None` -> X; anything else unchanged."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1:
            return options[0]
    return hint


def _flags(cls: type, default: Any = None, path: tuple[str, ...] = ()) -> Iterator[_Flag]:
    """Every leaf field of `cls` (nested sections flattened), with its effective default."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        value = getattr(default, field.name) if default is not None else _default(field)
        hint = _optional(hints[field.name])
        if dataclasses.is_dataclass(hint):
            yield from _flags(hint, value, (*path, field.name))
            continue
        if "cli" not in field.metadata:
            raise TypeError(f"{cls.__name__}.{field.name} has no cli(...) metadata: every "
                            "field of a command's config needs its help")
        yield _Flag((*path, field.name), hint, value, field.metadata["cli"])


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=VALUE")
    return name, value


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of config dataclass `cls` (see `cli`), in one argument group per
    nested section, plus `--config FILE`. Flags left out are left out of the parsed
    namespace too, so `config_from_flags` can tell a flag given from a default."""
    parser.add_argument("--config", type=Path, metavar="FILE", default=None,
                        help="a YAML file of these settings by field name (a nested "
                             "section as a nested mapping); flags given override it")
    groups: dict[tuple[str, ...], Any] = {(): parser}
    seen: dict[str, _Flag] = {}
    for flag in _flags(cls):
        section = flag.path[:-1]
        if section not in groups:
            groups[section] = parser.add_argument_group(".".join(section))
        if flag.name in seen:
            raise TypeError(f"{'.'.join(flag.path)} and {'.'.join(seen[flag.name].path)} "
                            f"both want {flag.name}")
        seen[flag.name] = flag
        spec, hint = flag.spec, flag.hint
        help_text = spec["help"]
        if spec["show_default"] and not spec["positional"] and flag.default is not None \
                and not isinstance(flag.default, bool) and flag.default not in ("", [], {}):
            help_text += f" (default: {flag.default})"
        if spec["env"]:
            help_text += f" (default: ${spec['env']})"
        kwargs: dict[str, Any] = {"help": help_text.replace("%", "%%"), "metavar": spec["metavar"]
                                  or flag.path[-1].upper()}
        origin = typing.get_origin(hint)
        if hint is bool:
            kwargs = {"help": kwargs["help"], "action": "store_const",
                      "const": not flag.default}
        elif origin is list:
            kwargs.update(action="append", type=typing.get_args(hint)[0])
        elif origin is dict:
            kwargs.update(action="append", type=_pair, metavar=spec["metavar"] or "NAME=VALUE")
        elif origin is typing.Literal or spec["choices"]:
            kwargs.update(choices=list(spec["choices"] or typing.get_args(hint)),
                          metavar=spec["metavar"])
        else:
            kwargs.update(type=hint)
        if spec["positional"]:
            # None, not SUPPRESS: argparse would run a string default through `type`
            groups[section].add_argument(flag.dest, nargs="?", default=None, **kwargs)
        else:
            groups[section].add_argument(flag.name, dest=flag.dest, default=argparse.SUPPRESS,
                                         **kwargs)


def config_from_flags(cls: type[T], args: argparse.Namespace) -> T:
    """The config `add_config_flags`' flags describe: `--config`'s file, then the flags
    given, then the fields' environment variables for what neither set, then the
    defaults. A field's error is reported in its flag's spelling."""
    flags = list(_flags(cls))
    data: dict[str, Any] = {}
    if getattr(args, "config", None) is not None:
        data = _read_yaml(args.config)
    for flag in flags:
        if getattr(args, flag.dest, None) is not None:
            value = getattr(args, flag.dest)
            if typing.get_origin(flag.hint) is dict:
                value = _pairs_to_dict(flag, value)
            _set_dotted(data, ".".join(flag.path), value)
        elif flag.spec["env"] and os.environ.get(flag.spec["env"]) \
                and not _has_dotted(data, flag.path):
            _set_dotted(data, ".".join(flag.path), os.environ[flag.spec["env"]])
        elif flag.spec["positional"] and not _has_dotted(data, flag.path):
            raise ConfigError(f"{flag.path[-1].upper()} is required: give it (or "
                              f"{'.'.join(flag.path)}: in --config's file)")
    try:
        return from_dict(cls, data)
    except ConfigError as error:
        if str(error).startswith("unknown field"):  # only a file's keys can be unknown
            raise ConfigError(f"--config {args.config}: {error}") from None
        raise ConfigError(_in_flag_names(str(error), flags)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not Path(path).is_file():
        raise ConfigError(f"--config {path} does not exist; give a YAML file")
    loaded = yaml.safe_load(Path(path).read_text())
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"--config {path} must be a YAML mapping of field: value")
    return loaded or {}


def _pairs_to_dict(flag: _Flag, pairs: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"{flag.name} {key}=...: the name {key!r} is given twice")
        out[key] = value
    return out


def _has_dotted(data: dict[str, Any], path: tuple[str, ...]) -> bool:
    node: Any = data
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _in_flag_names(message: str, flags: list[_Flag]) -> str:
    """`message` with the fields it names (`engine.decode_steps=0`, `max_loras=2`,
    `api_key`) in their flags' spelling: a field name followed by `=`, or one whose
    underscore or dot keeps it from being an ordinary word."""
    leaves = [flag.path[-1] for flag in flags]
    names: dict[str, str] = {}
    for flag in flags:
        label = flag.path[-1].upper() if flag.spec["positional"] else flag.name
        names[".".join(flag.path)] = label
        if leaves.count(flag.path[-1]) == 1:
            names[flag.path[-1]] = label
    pattern = re.compile(r"(?<![\w.-])(" + "|".join(
        re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")(?![\w.])")

    def spell(match: re.Match) -> str:
        name = match.group(1)
        follows = message[match.end():match.end() + 1]
        return names[name] if follows == "=" or "_" in name or "." in name else name
    return pattern.sub(spell, message)
