"""`lathe serve`'s command line is `ServerConfig`: every field has its flag and its help,
a YAML file gives the same settings, and a wrong value is refused in the flag's spelling
before a port is bound."""

import dataclasses
import typing
from pathlib import Path

import pytest

import lathe.serve.server
from lathe.core.errors import ConfigError
from lathe.serve.commands import serve_main
from lathe.serve.config import EngineConfig, ServerConfig, serving_engine


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        nested = hint if dataclasses.is_dataclass(hint) else (inner[0] if inner else None)
        if nested is not None:
            out += leaf_fields(nested, prefix + f.name + ".")
        else:
            out.append((prefix + f.name, f))
    return out


def test_help_lists_every_server_config_field(capsys):
    with pytest.raises(SystemExit):
        serve_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    fields = leaf_fields(ServerConfig)
    assert len(fields) > 40
    for name, f in fields:
        spec = f.metadata["cli"]
        dashed = name.rsplit(".", 1)[-1].replace("_", "-")
        flag = ("CHECKPOINT" if spec["positional"] else spec["negate"] or spec["flag"]
                or ("--no-" if f.default is True else "--") + dashed)
        assert flag in text, name
        assert " ".join(spec["help"].split())[:40] in text, name


@pytest.fixture
def started(monkeypatch):
    """The configs `lathe serve` would run, without running them."""
    configs: list[ServerConfig] = []
    monkeypatch.setattr(lathe.serve.server, "run", configs.append)
    monkeypatch.delenv("LATHE_API_KEY", raising=False)
    return configs


def test_the_defaults_are_server_configs(checkpoint, started):
    serve_main([str(checkpoint)])
    assert started == [ServerConfig(checkpoint=checkpoint)]
    assert started[0].engine == serving_engine() != EngineConfig()
    assert started[0].engine.compile_decode and started[0].engine.compile_in_background


def test_a_yaml_file_and_flags_over_it(checkpoint, started, tmp_path, monkeypatch):
    monkeypatch.setenv("LATHE_API_KEY", "env-key")
    recipe = tmp_path / "serve.yaml"
    recipe.write_text(f"checkpoint: {checkpoint}\nport: 9001\nengine:\n  max_num_seqs: 8\n"
                      "  speculative:\n    method: ngram\nlimits:\n  header_seconds: 3\n")
    serve_main(["--config", str(recipe), "--port", "9002", "--lora", f"a={checkpoint}"])
    config = started[0]
    assert config.port == 9002 and config.api_key == "env-key"
    assert config.limits.header_seconds == 3.0 and config.limits.body_seconds == 30.0
    # the engine keeps a server's defaults beside what the file set
    assert config.engine.max_num_seqs == 8 and config.engine.compile_decode
    assert config.engine.speculative.method == "ngram"
    assert config.loras == {"a": Path(checkpoint)} and config.engine.max_loras == 1


@pytest.mark.parametrize("argv, message", [
    (["--max-connections", "0"], r"--max-connections=0 must be >= 1"),
    (["--header-timeout", "0"], r"--header-timeout=0.0 must be > 0"),
    (["--max-num-seqs", "0"], r"--max-num-seqs=0 must be >= 1"),
    (["--gpu-memory-utilization", "1.5"], r"--gpu-memory-utilization=1.5 must be in \(0, 1\]"),
    (["--max-model-len", "0"], r"--max-model-len=0 must be >= 1"),
    (["--engine-threads", "0"], r"--engine-threads=0 must be >= 1"),
    (["--max-tool-calls", "0"], r"--max-tool-calls=0 must be >= 1"),
    (["--lora", "a=x", "--lora", "a=y"], r"--lora a=...: the name 'a' is given twice"),
    (["--lora", "a=x", "--lora", "b=y", "--max-loras", "1"],
     r"--max-loras=1 holds fewer adapters than the 2 loaded at start"),
    (["--weights-root", "."], r"--weights-root needs --api-key"),
    (["--lora-root", "/no/such/folder"], r"--lora-root: /no/such/folder is not a folder"),
    (["--num-speculative-tokens", "3"], r"--speculative=draft needs --draft"),
])
def test_a_wrong_flag_is_named(checkpoint, started, argv, message):
    with pytest.raises(ConfigError, match=message):
        serve_main([str(checkpoint), *argv])
    assert started == []


def test_a_missing_checkpoint_is_named(started):
    with pytest.raises(ConfigError, match="CHECKPOINT is required"):
        serve_main([])


@pytest.mark.parametrize("recipe", sorted(Path(__file__).resolve().parents[2].glob(
    "recipes/serve/*.yaml")), ids=lambda p: p.name)
def test_every_serving_recipe_loads(checkpoint, started, recipe):
    serve_main(["--config", str(recipe), str(checkpoint)])
    assert started[0].checkpoint == checkpoint


def test_a_files_unknown_key_is_named_as_the_file_spells_it(checkpoint, started, tmp_path):
    recipe = tmp_path / "serve.yaml"
    recipe.write_text("limits:\n  keep_alive_timeout: 3\n")
    with pytest.raises(ConfigError, match=r"--config .*serve.yaml: unknown field\(s\) "
                                          r"limits.keep_alive_timeout; .*idle_seconds"):
        serve_main(["--config", str(recipe), str(checkpoint)])
