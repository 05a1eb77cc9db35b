"""Every stage recipe under recipes/ loads into its typed config: a misspelt or removed
field fails here, not an hour into the README run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from lathe.core.config import load_config
from lathe.posttrain.config import DistillConfig, DPOConfig, GRPOConfig, SFTConfig
from lathe.pretrain.config import PretrainConfig

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"pretrain": PretrainConfig, "sft": SFTConfig, "dpo": DPOConfig,
          "grpo": GRPOConfig, "distill": DistillConfig}
RECIPES = sorted((stage, path) for stage in STAGES
                 for path in (ROOT / "recipes" / stage).glob("*.yaml"))


@pytest.mark.parametrize(("stage", "path"), RECIPES, ids=lambda v: getattr(v, "name", v))
def test_recipe_loads_into_its_stage_config(stage, path):
    config = load_config(STAGES[stage], path)
    assert config.out_dir


def test_the_readme_run_uses_recipes_that_exist():
    script = (ROOT / "recipes" / "e2e.sh").read_text()
    for stage in STAGES:
        assert f"recipes/{stage}/e2e.yaml" in script, stage
        assert (ROOT / "recipes" / stage / "e2e.yaml").is_file(), stage
    for recipe in ("recipes/sft/tools.yaml", "recipes/grpo/tools.yaml"):  # the tool stage
        assert recipe in script and (ROOT / recipe).is_file(), recipe


def _readme_stage_commands() -> list[tuple[str, str, list[str]]]:
    """Each `lathe <stage> --config recipes/... --overrides` line of the README, continuation
    lines joined: (stage, recipe, override arguments)."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    pattern = re.compile(rf"lathe ({'|'.join(STAGES)}) --config (recipes/\S+\.yaml)(.*)")
    return [(m[1], m[2], shlex.split(m[3], comments=True)) for m in pattern.finditer(text)]


README_COMMANDS = _readme_stage_commands()


def test_the_readme_shows_stage_commands():
    assert {stage for stage, _, _ in README_COMMANDS} >= {"sft", "dpo", "grpo", "distill"}


@pytest.mark.parametrize(("stage", "recipe", "overrides"), README_COMMANDS,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_readme_command_loads_with_its_overrides(stage, recipe, overrides):
    """A recipe change must not break the README's examples of overriding it (an async GRPO
    example against a recipe that samples dynamically is refused by the config)."""
    config = load_config(STAGES[stage], ROOT / recipe, overrides)
    assert config.out_dir
