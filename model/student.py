"""A distillation student initialized from its teacher: the teacher's embeddings, final norm
and LM head, and a chosen subset of its decoder layers (DistilBERT takes one layer in two).
A student that starts from the teacher's weights rather than from noise learns its
behaviour in far fewer steps, and shares its tokenizer by construction."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lathe.core.errors import ConfigError
from lathe.model.transformer import Transformer


def student_from_teacher(teacher: Transformer, layers: Sequence[int]) -> Transformer:
    """A `len(layers)`-layer copy of `teacher` keeping decoder layers `layers`, in order."""
    count = teacher.config.n_layers
    if not layers or any(not 0 <= i < count for i in layers) or list(layers) != sorted(
            set(layers)):
        raise ConfigError(f"keep_layers={list(layers)} must be distinct increasing layer "
                          f"indices in [0, {count}) of the teacher, e.g. 0,{count - 1}")
    per_layer = {name: [getattr(teacher.config, name)[i] for i in layers]
                 for name in ("layer_types", "no_rope_layers")
                 if getattr(teacher.config, name) is not None}  # each kept layer keeps its own
    config = dataclasses.replace(teacher.config, n_layers=len(layers), **per_layer)
    student = Transformer(config).to(teacher.model.embed_tokens.weight.dtype)
    state = {}
    for name, tensor in teacher.state_dict().items():
        if name.startswith("model.layers."):
            index, rest = name.removeprefix("model.layers.").split(".", 1)
            if int(index) not in layers:
                continue
            name = f"model.layers.{list(layers).index(int(index))}.{rest}"
        state[name] = tensor
    student.load_state_dict(state)
    return student
