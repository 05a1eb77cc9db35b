"""Reading a checkpoint folder's files safely: which file a name may stand for (the
symlink policy), JSON files as objects and the end-of-sequence ids of
generation_config.json (what the model stops on, which serving and the chat renderer's
masks both need), each failure one `CheckpointError`.

Symlink policy. A checkpoint folder is often a snapshot of the Hugging Face cache, whose
files are links into the repository's blob store (`models--org--name/snapshots/REV/
config.json -> ../../blobs/SHA`). A link is followed only when its target stays inside
the checkpoint folder or, for such a snapshot, inside its repository folder
(`models--org--name`); any other link — to /dev/zero, to another user's files, out of a
downloaded archive — is refused with the file and where it points. The folder itself may
be a link: it is where the user pointed.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from lathe.core.errors import CheckpointError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"  # a multimodal processor's chat template

MAX_JSON_BYTES = 256 << 20  # a large tokenizer.json (Gemma's) is ~35 MB


def allowed_root(folder: Path) -> Path:
    """The folder links inside `folder` may point into (see the module's policy)."""
    folder = folder.resolve()
    snapshots = folder.parent
    if snapshots.name == "snapshots" and (snapshots.parent / "blobs").is_dir():
        return snapshots.parent
    return folder


def checkpoint_file(folder: str | Path, name: str) -> Path:
    """`folder/name` where it is allowed to resolve (the file need not exist); a link
    that leaves the folder is a `CheckpointError` naming it and its target."""
    path = Path(folder) / name
    if not path.is_symlink() and not any(p.is_symlink() for p in _inner_parents(folder, name)):
        return path
    try:
        target = path.resolve()
    except (RuntimeError, OSError) as error:  # a loop of links, or one that cannot be read
        raise CheckpointError(f"{path}: a link that cannot be followed ({error})") from None
    root = allowed_root(Path(folder))
    if not target.is_relative_to(root):
        raise CheckpointError(f"{path}: is a link to {target}, outside the checkpoint folder "
                              f"{root}; lathe follows links only inside it (or inside a "
                              "Hugging Face cache repository) — copy the file in instead")
    return path


def _inner_parents(folder: str | Path, name: str) -> list[Path]:
    parts = Path(name).parts[:-1]
    return [Path(folder).joinpath(*parts[:i + 1]) for i in range(len(parts))]


def read_json_if_present(file: Path) -> dict[str, Any]:
    """`read_json_object` of an optional file: an empty dict when it is absent."""
    return read_json_object(file) if file.is_file() else {}


def read_json_object(file: Path) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict, or one `CheckpointError` saying what is wrong
    (unreadable, too large, not JSON, nested too deep, or not an object)."""
    try:
        if not stat.S_ISREG(os.stat(file).st_mode):  # before opening: a FIFO would block
            raise CheckpointError(f"{file}: not a regular file (a device, pipe or folder); "
                                  "a checkpoint's JSON files are plain files")
        with open(file, "rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise CheckpointError(f"{file}: more than {MAX_JSON_BYTES} bytes, more than any "
                                  "checkpoint's JSON file; it is not a config")
        data = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{file}: cannot be read ({error})") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{file}: not valid JSON ({error}); restore or re-export "
                              "the checkpoint") from None
    except RecursionError:
        raise CheckpointError(f"{file}: nested too deeply to be a config; restore or "
                              "re-export the checkpoint") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: must hold a JSON object, not a {type(data).__name__}")
    return data


def read_config_json(folder: str | Path) -> dict[str, Any]:
    """A checkpoint folder's config.json as a dict, not yet checked as a model's: what a
    process that loads no model (a server's front end) checks before it starts one."""
    file = checkpoint_file(folder, CONFIG_FILE)
    if not file.is_file():
        raise CheckpointError(
            f"{folder}: no {CONFIG_FILE}; a checkpoint is a folder with {CONFIG_FILE} and "
            "model.safetensors (write one with `lathe init` or save_checkpoint)")
    return read_json_object(file)


def read_eos_ids(path: str | Path, vocab_size: int) -> list[int]:
    """The end-of-sequence ids in a checkpoint's generation_config.json (an id or a list of
    them; none when the file or the field is absent), each checked against the vocabulary."""
    file = checkpoint_file(path, GENERATION_CONFIG_FILE)
    eos = read_json_if_present(file).get("eos_token_id")
    if eos is None:
        return []
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                          for t in ids):
        raise CheckpointError(f"{file}: eos_token_id={eos!r} must be a token id in "
                              f"[0, {vocab_size}) or a non-empty list of them")
    return ids


def read_processor_template(folder: str | Path) -> str | None:
    """The chat template of a multimodal processor's chat_template.json (Gemma 3's from 4B
    up), None when the folder has none."""
    file = checkpoint_file(folder, PROCESSOR_TEMPLATE_FILE)
    if not file.is_file():
        return None
    template = read_json_object(file).get("chat_template")
    if not isinstance(template, str):
        raise CheckpointError(f"{file}: chat_template must be a string (one Jinja template), "
                              f"not {type(template).__name__}")
    return template or None
