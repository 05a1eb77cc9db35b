"""Every stage recipe under recipes/ loads into its typed config: a misspelt or removed
field fails here, not an hour into the README run."""

from __future__ import annotations

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
