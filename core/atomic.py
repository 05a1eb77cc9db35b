"""Atomic writes: a folder appears complete under its final name, or not at all.

Every stage writes through these (checkpoints, shards, training state), so a run
killed at any moment leaves either the previous complete output or none, plus at
most a hidden `.NAME.tmp-*` leftover that the next write ignores.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `path` in one rename.

    An existing `path` is moved aside first and deleted only after the new folder is
    in place. On an exception the temporary folder is removed and `path` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        publish_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_directory(tmp: str | Path, path: str | Path) -> None:
    """Make the completely written folder `tmp` appear as `path` in one rename.

    For writers that cannot use `atomic_directory` as a context manager, e.g. several
    processes filling one folder. An existing `path` is replaced.
    """
    tmp, path = Path(tmp), Path(path)
    _finish_tree(tmp)
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync(path.parent)
    if old is not None:
        shutil.rmtree(old)


def _finish_tree(root: Path) -> None:
    """fsync every file and folder, and give them the modes a plain write would have
    (mkdtemp makes 0700 folders; some writers, safetensors among them, make 0600 files)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _finish(Path(dirpath) / name, 0o666)
        _finish(Path(dirpath), 0o777)


def _finish(path: Path, mode: int) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path to write; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _finish(tmp, 0o666)
        os.replace(tmp, path)
        _fsync(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | Path, data: Any) -> None:
    """Write `data` as indented JSON, atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
