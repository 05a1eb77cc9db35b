"""The top-level import name `kernels`, which this folder takes whenever the repository root is
first on `sys.path` (`python -m` run from a checkout, pytest): that name belongs to Hugging Face's
`kernels` distribution, which transformers (5.25 and later) requires and imports by it. lathe
itself is only ever imported as `lathe.kernels`, so a plain `import kernels` that lands here is
given the distribution instead."""

import importlib.metadata
import importlib.util
import sys
from pathlib import Path


def hand_over_name() -> None:
    """Load the installed `kernels` distribution as `sys.modules["kernels"]`, in place of this
    folder. Without one installed, the folder keeps the name (nothing else claims it)."""
    try:
        distribution = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    init = Path(distribution.locate_file("kernels/__init__.py"))
    if not init.is_file():
        return
    spec = importlib.util.spec_from_file_location(
        "kernels", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise
