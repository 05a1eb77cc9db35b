"""The GRPO rollout bench (`python -m lathe.posttrain.rollout_bench`) refuses a folder
that holds no model before any of its runs starts."""

from __future__ import annotations

import pytest

from lathe.posttrain.rollout_bench import main


def test_a_folder_without_a_model_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--checkpoint", str(tmp_path), "--no-write"])
    assert exit_.value.code == 2
    assert f"--checkpoint={tmp_path}: no config.json" in capsys.readouterr().err
