"""The wheel installs everything under `lathe.` and nothing generic at the top level, and
the packages import each other only along the arrows docs/design.md draws."""

import ast
import sys
import zipfile
from pathlib import Path

import pytest

from tests import processes

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "model", "data", "pretrain", "posttrain", "serve", "kernels")
# package -> the lathe packages its modules may import (besides itself); every one may
# import core, core imports none
MAY_IMPORT = {
    "core": set(),
    "kernels": {"core"},
    "model": {"core", "kernels"},
    "data": {"core"},
    "serve": {"core", "model", "kernels", "data"},
    "pretrain": {"core", "model", "data", "kernels"},
    "posttrain": {"core", "model", "data", "kernels", "pretrain", "serve"},
}


def lathe_imports(file: Path) -> set[str]:
    """The lathe packages a module imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found |= {n.split(".")[1] for n in names if n.startswith("lathe.")}
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_each_other_only_along_the_arrows(package):
    for file in (ROOT / package).rglob("*.py"):
        wrong = lathe_imports(file) - MAY_IMPORT[package] - {package}
        assert not wrong, f"{file.relative_to(ROOT)} imports lathe.{', lathe.'.join(wrong)}"


@pytest.mark.slow
def test_wheel_maps_each_folder_under_the_lathe_namespace(tmp_path):
    processes.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                   "-q", "-w", str(tmp_path), str(ROOT)], timeout=300)
    (wheel,) = tmp_path.glob("lathe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"lathe", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                         + ".dist-info"}
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):  # subpackages too
            assert f"lathe/{init.relative_to(ROOT).as_posix()}" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names
                                                    if n.endswith("entry_points.txt")))
    assert b"lathe = lathe.core.cli:main" in entry_points


def test_from_a_checkout_root_import_kernels_is_the_kernels_distribution():
    """Run from the repository root (`python -m`, pytest), the `kernels/` folder is found first
    under the top-level name of Hugging Face's `kernels`, which transformers >= 5.25 imports
    (`from kernels import CUDAProperties`) whenever a model module loads; lathe's folder must
    hand that name over, and stay `lathe.kernels`."""
    import importlib.metadata

    try:
        distribution = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the kernels distribution is not installed (transformers < 5.25)")
    code = ("import kernels, lathe.kernels\n"
            "from kernels import CUDAProperties\n"
            "import transformers.modeling_utils\n"
            "print(kernels.__file__); print(lathe.kernels.__file__)\n")
    result = processes.run([sys.executable, "-c", code], timeout=120, cwd=ROOT)
    theirs, ours = result.stdout.split()[-2:]
    assert Path(theirs) == Path(distribution.locate_file("kernels/__init__.py"))
    assert Path(ours).resolve() == (ROOT / "kernels" / "__init__.py").resolve()


def test_training_imports_no_torchao_and_lora_imports_it_quietly():
    """torchao (and the torch warnings its import sets off) loads only for FP8; a LoRA
    run imports it through peft, with its import-time log lines silenced."""
    code = ("import sys\n"
            "import lathe.posttrain.grpo, lathe.posttrain.distill, lathe.pretrain.train\n"
            "assert 'torchao' not in sys.modules and 'peft' not in sys.modules\n"
            "from lathe.model.lora import LoraSection, apply_lora\n"
            "from tests.builders import tiny_model\n"
            "apply_lora(tiny_model(n_layers=1), LoraSection(enabled=True))\n"
            "assert 'peft' in sys.modules\n")
    result = processes.run([sys.executable, "-c", code], timeout=120, cwd=ROOT)
    for noise in ("Failed to load", "_pytree", "register_constant"):
        assert noise not in result.stderr, result.stderr


def test_importing_every_stage_and_loading_a_checkpoint_import_no_torch_compiler(tmp_path):
    """torch._dynamo takes ~1.5 s to import; a process that never compiles (an eval, a CPU
    training stage, a server without compiled steps) must not pay it, at import or when it
    loads a checkpoint; nor a CPU server's engine before it is ready, whose compiled steps
    are built in the background (the build imports it)."""
    code = ("import sys\n"
            "import lathe.model, lathe.serve.engine, lathe.posttrain.grpo, lathe.pretrain.train\n"
            "from lathe.model import ModelConfig, Transformer\n"
            "from lathe.model.checkpoint import load_checkpoint, save_checkpoint\n"
            "from lathe.serve.config import serving_engine\n"
            "config = ModelConfig.from_preset('tiny', vocab_size=64, n_layers=1)\n"
            f"save_checkpoint(Transformer(config), {str(tmp_path)!r})\n"
            f"load_checkpoint({str(tmp_path)!r})\n"
            "engine = lathe.serve.engine.LLMEngine.from_checkpoint(\n"
            f"    {str(tmp_path)!r}, serving_engine())\n"
            "assert engine.runner.graphs is not None and engine.builds_in_background\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n")
    processes.run([sys.executable, "-c", code], timeout=120, cwd=ROOT)


def test_the_server_front_end_imports_no_torch():
    """`lathe serve`'s own process — flags, HTTP, templates, request checks, streaming —
    holds no torch (hundreds of MB and seconds of import); only its engine core's does."""
    code = ("import sys\n"
            "import lathe.serve.commands, lathe.serve.server\n"
            "from lathe.serve.commands import serve_main\n"
            "heavy = sorted(m for m in ('torch', 'numpy', 'triton') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    processes.run([sys.executable, "-c", code], timeout=120, cwd=ROOT)
