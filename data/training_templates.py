"""Training versions of the open families' own chat templates, as TRL ships them.

A family's template as its checkpoints carry it often cannot say which tokens the assistant
wrote: it has no `{% generation %}` blocks, and some rewrite earlier turns once later ones
follow (Qwen3 drops past reasoning), so a turn's text depends on what comes after it. TRL
keeps, beside each template it knows (`trl/chat_templates/NAME.jinja`), a training version
(`NAME_training.jinja`): the same rendering with `{% generation %}` blocks around what the
assistant writes, and prefix-preserving, so every turn renders as it did when it was the
last. `training_template` finds the training version of a template by its text (line ends
and surrounding whitespace aside): Qwen2.5, Qwen3 and its 2507/3.5/3.6/3.8 versions,
Llama 3, Gemma and Gemma 3, Phi-3 and 3.5, GLM-4.5 (glm4moe), DeepSeek-V3 and R1, GPT-OSS,
Cohere, LFM2, Nemotron 3 among them.
"""

from __future__ import annotations

import functools
from importlib.util import find_spec
from pathlib import Path


@functools.cache
def _known() -> dict[str, tuple[str, str]]:
    """Each known template's normalized text -> (its name, its training version). TRL's
    folder is found without importing trl, whose import (~1 s) every chat stage would pay."""
    spec = find_spec("trl")
    if spec is None:
        raise ModuleNotFoundError("trl is not installed: lathe reads the training versions of "
                                  "the families' chat templates from it; pip install 'trl>=1.16'")
    folder = Path(spec.submodule_search_locations[0]) / "chat_templates"
    known = {}
    for entry in folder.iterdir():
        name = entry.name.removesuffix(".jinja")
        training = folder / f"{name}_training.jinja"
        if entry.name.endswith(".jinja") and not name.endswith("_training") \
                and training.is_file():
            known[_normalized(entry.read_text(encoding="utf-8"))] = (
                name, training.read_text(encoding="utf-8"))
    return known


def _normalized(template: str) -> str:
    return template.replace("\r\n", "\n").strip()


def training_template(template: str) -> tuple[str, str] | None:
    """(TRL's name for it, its training version) when `template` is a known family template
    without `{% generation %}` blocks; None otherwise."""
    return _known().get(_normalized(template))
