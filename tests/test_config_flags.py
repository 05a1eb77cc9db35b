"""Flags generated from a config dataclass (`lathe.core.config.add_config_flags`): one per
field, nested sections flattened, a YAML file beneath them, defaults and checks from the
dataclasses alone, errors in the flags' spelling."""

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from lathe.core.config import add_config_flags, cli, config_from_flags, from_dict
from lathe.core.errors import ConfigError


@dataclass
class Inner:
    steps: int = field(default=1, metadata=cli("steps a run takes"))
    warm: bool = field(default=False, metadata=cli("warm up", negate="--cold"))

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"steps={self.steps} must be >= 1")


@dataclass
class Optional_:
    kind: Literal["a", "b"] = field(default="a", metadata=cli("which", flag="--kind-of"))


@dataclass
class Outer:
    target: Path = field(metadata=cli("what to run on", positional=True))
    rate_seconds: float = field(default=2.0, metadata=cli("a rate", flag="--rate"))
    key: str | None = field(default=None, metadata=cli("a key", env="TEST_FLAGS_KEY"))
    roots: list[Path] = field(default_factory=list, metadata=cli("roots", flag="--root"))
    named: dict[str, Path] = field(default_factory=dict, metadata=cli("named", flag="--name"))
    inner: Inner = field(default_factory=lambda: Inner(warm=True))
    extra: Optional_ | None = None


def parse(argv: list[str]) -> Outer:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Outer)
    return config_from_flags(Outer, parser.parse_args(argv))


def test_defaults_are_the_dataclasses_and_a_section_keeps_its_parents_default(monkeypatch):
    monkeypatch.delenv("TEST_FLAGS_KEY", raising=False)
    assert parse(["x"]) == Outer(Path("x"))
    # inner's default is its parent's (warm on), and a flag on one field keeps the rest
    config = parse(["x", "--steps", "3"])
    assert config.inner == Inner(steps=3, warm=True)
    assert parse(["x", "--cold"]).inner == Inner(warm=False)
    assert parse(["x"]).extra is None  # an optional section nobody set stays off
    assert parse(["x", "--kind-of", "b"]).extra == Optional_("b")


def test_lists_maps_paths_and_the_environment(monkeypatch):
    monkeypatch.setenv("TEST_FLAGS_KEY", "from-env")
    config = parse(["x", "--root", "r1", "--root", "r2", "--name", "a=p", "--rate", "5"])
    assert config.roots == [Path("r1"), Path("r2")] and config.named == {"a": Path("p")}
    assert config.rate_seconds == 5.0 and config.key == "from-env"
    assert parse(["x", "--key", "given"]).key == "given"
    with pytest.raises(ConfigError, match="--name a=...: the name 'a' is given twice"):
        parse(["x", "--name", "a=p", "--name", "a=q"])


def test_a_yaml_file_beneath_the_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_FLAGS_KEY", "from-env")
    recipe = tmp_path / "c.yaml"
    recipe.write_text("target: t\nkey: from-file\ninner:\n  steps: 4\nextra:\n  kind: b\n")
    config = parse(["--config", str(recipe), "--steps", "6"])
    assert config.target == Path("t") and config.key == "from-file"  # the file beats $ENV
    assert config.inner == Inner(steps=6, warm=True) and config.extra == Optional_("b")
    recipe.write_text("inner:\n  stepz: 4\n")
    with pytest.raises(ConfigError, match="unknown field.*inner.stepz"):
        parse(["--config", str(recipe), "x"])


def test_errors_name_the_flag():
    with pytest.raises(ConfigError, match=r"^--steps=0 must be >= 1$"):
        parse(["x", "--steps", "0"])
    with pytest.raises(ConfigError, match="TARGET is required"):
        parse([])
    with pytest.raises(SystemExit):  # argparse: a value of the wrong type
        parse(["x", "--steps", "many"])


def test_every_field_needs_its_help():
    @dataclass
    class Bare:
        n: int = 1

    with pytest.raises(TypeError, match="Bare.n has no cli"):
        add_config_flags(argparse.ArgumentParser(), Bare)


def test_from_dict_coerces_paths_and_map_values():
    assert from_dict(Outer, {"target": "t", "named": {"a": "p"}}).named == {"a": Path("p")}
    with pytest.raises(ConfigError, match="target=3 must be a path"):
        from_dict(Outer, {"target": 3})
