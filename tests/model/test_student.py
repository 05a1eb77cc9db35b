"""A student cut from a teacher's layers computes what the teacher's kept layers compute."""

from __future__ import annotations

import pytest
import torch

from lathe.core.errors import ConfigError
from lathe.model import ModelConfig, Transformer, load_checkpoint, save_checkpoint
from lathe.model.commands import init_main
from lathe.model.student import student_from_teacher


def teacher() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_preset("tiny", vocab_size=96)).eval()


def test_keeping_every_layer_is_the_teacher_and_a_subset_skips_the_rest():
    model, ids = teacher(), torch.randint(0, 96, (2, 9))
    assert torch.equal(student_from_teacher(model, [0, 1, 2, 3])(ids).logits, model(ids).logits)
    student = student_from_teacher(model, [0, 3])
    assert student.config.n_layers == 2
    skipped = Transformer(model.config).eval()
    skipped.load_state_dict(model.state_dict())
    skipped.model.layers = torch.nn.ModuleList([skipped.model.layers[0],
                                                skipped.model.layers[3]])
    torch.testing.assert_close(student(ids).logits, skipped(ids).logits)


def test_a_gemma_student_keeps_each_kept_layers_window_and_rope():
    """Gemma 3's layers differ (sliding or full, local or global RoPE): a student cut from
    layers 1 and 3 of [sliding, sliding, sliding, full] is [sliding, full], as the teacher's
    kept layers compute."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_preset("tiny", vocab_size=96, family="gemma3_text",
                                                sliding_window=4, layer_types=[
                                                    "sliding_attention"] * 3
                                                + ["full_attention"])).eval()
    student = student_from_teacher(model, [1, 3])
    assert student.config.layer_types == ["sliding_attention", "full_attention"]
    ids = torch.randint(0, 96, (1, 12))
    skipped = Transformer(model.config).eval()
    skipped.load_state_dict(model.state_dict())
    skipped.model.layers = torch.nn.ModuleList([skipped.model.layers[1],
                                                skipped.model.layers[3]])
    torch.testing.assert_close(student(ids).logits, skipped(ids).logits)


@pytest.mark.parametrize("layers", [[], [4], [2, 1], [1, 1]])
def test_bad_layer_lists_name_the_fix(layers):
    with pytest.raises(ConfigError, match="keep_layers"):
        student_from_teacher(teacher(), layers)


def test_init_from_teacher_writes_a_loadable_student(tmp_path, capsys):
    save_checkpoint(teacher(), tmp_path / "teacher")
    assert init_main(["--from-teacher", str(tmp_path / "teacher"), "--keep-layers", "0,-1",
                      "--out", str(tmp_path / "student")]) == 0
    assert "layers [0, 3]" in capsys.readouterr().out
    assert load_checkpoint(tmp_path / "student").config.n_layers == 2
    assert init_main(["--from-teacher", str(tmp_path / "teacher"), "--out",
                      str(tmp_path / "halved")]) == 0
    assert "layers [0, 2]" in capsys.readouterr().out  # by default one layer in two
    with pytest.raises(ConfigError, match="drop"):
        init_main(["--from-teacher", str(tmp_path / "teacher"), "--out",
                   str(tmp_path / "x"), "--n_layers=2"])
