"""Questions about standard-library functions, answered by the first sentence of their
docstrings: "What does textwrap.dedent do?" -> "Remove any common leading whitespace
from every line in `text`." Built from this Python's own modules."""

from __future__ import annotations

import importlib
import inspect
import re

from lathe.data.tasks import PreferencePair, TaskExample, split_of

MODULES = ("json", "os.path", "math", "re", "string", "textwrap", "itertools", "functools",
           "collections", "random", "statistics", "shutil", "base64", "binascii", "bisect",
           "heapq", "fnmatch", "glob", "html", "zlib", "gzip", "csv", "calendar", "copy",
           "difflib", "hashlib", "keyword", "operator", "pprint", "shlex", "urllib.parse",
           "uuid", "datetime", "tempfile", "warnings", "inspect", "types", "enum", "dataclasses")
SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def first_sentence(doc: str) -> str | None:
    paragraph = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    sentence = SENTENCE_END.split(paragraph, maxsplit=1)[0].strip()
    return sentence if 10 <= len(sentence) <= 160 and sentence[0].isupper() else None


def stdlib_qa_examples(split: str, limit: int | None = None) -> list[TaskExample]:
    rows = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(getattr(module, "__all__", None) or dir(module)):
            obj = getattr(module, name, None)
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            sentence = first_sentence(obj.__doc__ or "")
            question = f"What does {module_name}.{name} do?"
            if sentence is None or split_of(question) != split:
                continue
            rows.append(TaskExample(question, sentence, sentence))
    return rows[:limit]


def stdlib_qa_preferences(split: str, limit: int | None = None) -> list[PreferencePair]:
    """The function's own docstring sentence chosen over the next function's."""
    rows = stdlib_qa_examples(split, limit)
    return [PreferencePair(row.prompt, row.answer, rows[(i + 1) % len(rows)].answer)
            for i, row in enumerate(rows) if len(rows) > 1]
