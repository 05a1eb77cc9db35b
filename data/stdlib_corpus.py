"""The embedded default corpus: the running Python's standard library, on every machine
with no download. Its `.py` files become code documents and `pydoc.HTMLDoc` pages of its
top-level modules become raw-HTML documents. It is used as it is — repeated licence
headers, author e-mails, generated tables and near-identical modules included — because
that dirt is what the cleaning stages are for."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import io
import pydoc
import re
import sys
import sysconfig
import types
from collections.abc import Iterator
from pathlib import Path

from lathe.data.document import Rejected
from lathe.data.sources import InputShard, Record, SourceConfig, read_utf8, text_document

# Importing these has side effects (a browser, a Tk window, a printed poem) or needs a
# platform this is not.
_SKIP_MODULES = {"antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle",
                 "__main__", "__hello__", "__phello__", "_tkinter"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_files() -> list[Path]:
    root = stdlib_root()
    return sorted(p for p in root.rglob("*.py")
                  if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def documented_modules() -> list[str]:
    names = sorted(n for n in sys.stdlib_module_names
                   if not n.startswith("_") and n not in _SKIP_MODULES)
    return [n for n in names if importlib.util.find_spec(n) is not None]


def stdlib_shards(config: SourceConfig) -> list[InputShard]:
    files = [str(p) for p in python_files()]
    modules = documented_modules()
    step = config.files_per_shard
    shards = [InputShard(f"stdlib-py-{i // step:05d}", functools.partial(read_python_files,
                                                                         files[i:i + step], config))
              for i in range(0, len(files), step)]
    page_step = max(1, step // 8)  # rendering a page costs more than reading a file
    shards += [InputShard(f"stdlib-pydoc-{i // page_step:05d}",
                          functools.partial(read_pydoc_pages, modules[i:i + page_step], config))
               for i in range(0, len(modules), page_step)]
    return shards


def read_python_files(paths: list[str], config: SourceConfig) -> Iterator[Record]:
    root = stdlib_root()
    for path in paths:
        relative = str(Path(path).relative_to(root))
        value = read_utf8(path)
        if value is None:
            yield Rejected(relative, "invalid_utf8")
            continue
        yield text_document(value, f"stdlib/{relative}", relative, config, kind="code",
                            metadata={"source": "stdlib", "path": relative})


# object reprs hold memory addresses ("<object object at 0x7f3a...>", "<PyDLL 'None',
# handle 7f64...>"), which differ between runs; the corpus must not
_ADDRESS = re.compile(r"\b(0x|handle )[0-9a-fA-F]{6,}\b")
# os.environ, as a module value or a default argument (cgi.FieldStorage), would put this
# machine's environment, secrets included, into the corpus
_ENVIRONMENT = re.compile(r"environ\(\{.*?\}\)", re.DOTALL)
# a module's warning registry counts the warnings filters this process has changed, and
# `import __main__` names a spawned worker's main module __mp_main__
_PROCESS_STATE = [(re.compile(r"(<br>\n)?<strong>__warningregistry__</strong> = \{[^}]*\}"), ""),
                  (re.compile(r"\b__mp_main__\b"), "__main__")]


def _machine_paths() -> list[tuple[str, str]]:
    """Where this Python, its virtual environment and the user's home lie, each with the
    path that stands for it in the corpus, longest first so a nested path goes first.
    `site` shows the venv's prefix, `platform` the interpreter, every page the stdlib's
    file: without this, a clone in another folder trains on another corpus (and a
    different model), so two README runs of one commit do not match."""
    paths = {sys.executable: "/venv/bin/python", sys.prefix: "/venv", sys.exec_prefix: "/venv",
             sys.base_prefix: "/usr/local", sys.base_exec_prefix: "/usr/local",
             str(Path.home()): "/home/user"}
    return sorted(((path, stand_in) for path, stand_in in paths.items() if len(path) > 1),
                  key=lambda item: -len(item[0]))


def _routines_and_classes(module: types.ModuleType) -> types.ModuleType:
    """A stand-in for `module` holding its docstring, functions and classes only."""
    copy = types.ModuleType(module.__name__, module.__doc__)
    for member, value in vars(module).items():
        if inspect.isroutine(value) or inspect.isclass(value):
            setattr(copy, member, value)
    return copy


@functools.cache
def _import_documented() -> None:
    """Import every documented module, once per process, before any page is rendered: a
    page shows what other modules did to its module (pyexpat's classes once xml.parsers
    is imported, asynchat's data after asyncore), so pages rendered by workers that had
    imported different modules before differed, and so did the stage counts of two runs
    of one recipe."""
    for name in documented_modules():
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def render_pydoc(name: str) -> str:
    """The HTML page `pydoc -w NAME` would write, rendered in memory, the same in every
    run, worker and checkout: no process state (environment, argv, warning registries,
    the main module's name, which modules this process imported before), no memory
    addresses and no machine paths."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        _import_documented()
        module = importlib.import_module(name)
        if module is sys:  # its data (path, stdin, meta_path, flags, ...) is process state
            module = _routines_and_classes(module)
        html = pydoc.HTMLDoc()
        page = html.page(pydoc.describe(module), html.document(module, name))
    page = _ENVIRONMENT.sub("environ({...})", page)
    for pattern, replacement in _PROCESS_STATE:
        page = pattern.sub(replacement, page)
    for path, stand_in in _machine_paths():
        page = re.sub(re.escape(path) + r"(?![\w.-])", stand_in, page)
    return _ADDRESS.sub(lambda match: match.group(1) + "...", page)


def read_pydoc_pages(names: list[str], config: SourceConfig) -> Iterator[Record]:
    for name in names:
        try:
            page = render_pydoc(name)
        except Exception:  # a module that fails to import here is not a document
            yield Rejected(f"pydoc:{name}", "import_failed")
            continue
        yield text_document(page, f"pydoc/{name}", f"pydoc:{name}", config, is_html=True,
                            kind="prose", metadata={"source": "stdlib-pydoc", "module": name})
