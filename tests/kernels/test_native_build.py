"""The native CPU kernels' build cannot hang a start: a builder that died leaves nothing
that blocks the next start, a live one is waited for only so long (then the references
run, with one warning), environments do not share a build, and torch's own stale build
locks are reported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lathe.kernels import cpu_native
from lathe.kernels.cpu_native import build_folder, build_lock, load_cpu_kernels
from tests import processes

HOLD = """
import fcntl, sys, time
handle = open(sys.argv[1], "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
handle.write("{pid}"); handle.flush()
print("held", flush=True)
time.sleep(120)
"""


def hold_lock(path: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD.replace("{pid}", "4242"), str(path)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def this_build_folder() -> Path:
    """The folder `load_cpu_kernels` builds in for this process."""
    isa = torch.backends.cpu.get_cpu_capability()
    return build_folder(isa, ["-O3", "-ffast-math", "-fopenmp",
                              *cpu_native._ISA_FLAGS.get(isa, [])])


def test_a_lock_whose_holder_was_killed_is_taken_at_once(tmp_path):
    lock = tmp_path / "build.lock"
    holder = hold_lock(lock)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert lock.read_text() == "4242"  # the file stays; the lock went with its holder
    start = time.monotonic()
    with build_lock(lock, wait_seconds=5):
        assert lock.read_text() == str(os.getpid())
    assert time.monotonic() - start < 1


def test_a_live_builder_is_waited_for_only_so_long(tmp_path):
    lock = tmp_path / "build.lock"
    holder = hold_lock(lock)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="still held by pid 4242 after 0.5 s"), \
                build_lock(lock, wait_seconds=0.5):
            pass
        assert time.monotonic() - start < 3
    finally:
        holder.kill()
        holder.wait()


def test_a_library_that_fails_its_check_is_not_published_nor_built_again(tmp_path,
                                                                          monkeypatch):
    """A build whose check process dies (as every extension built by one GPU machine's
    toolchain died on its first refused input) is recorded as refused; the next start
    raises at once instead of building it again, and a passing check publishes."""
    from torch.utils import cpp_extension
    builds = []

    def fake_load(name, sources, build_directory, **_):  # the compiler's part, not tested
        builds.append(name)
        Path(build_directory, f"{name}.so").write_bytes(b"not a real library")
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    folder = tmp_path / "cpu-test"
    dies = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    with pytest.raises(RuntimeError, match="killed by signal 11"):
        cpu_native.build_library(folder, [], [], [], dies)
    assert builds == [cpu_native.LIBRARY] and not (folder / f"{cpu_native.LIBRARY}.so").exists()
    with pytest.raises(RuntimeError, match=f"signal 11.*delete {folder}"):
        cpu_native.build_library(folder, [], [], [], dies)
    assert len(builds) == 1
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"  # the OOM killer
    with pytest.raises(RuntimeError, match="killed by signal 9"):
        cpu_native.build_library(tmp_path / "cpu-killed", [], [], [], killed)
    assert not (tmp_path / "cpu-killed" / cpu_native.REFUSED).exists()  # tried again later
    verdict = f"import sys; sys.exit({cpu_native.PROBE_VERDICT!r})"
    with pytest.raises(RuntimeError, match="must refuse"):
        cpu_native.build_library(tmp_path / "cpu-accepts", [], [], [], verdict)
    assert (tmp_path / "cpu-accepts" / cpu_native.REFUSED).exists()
    passes = "import sys, pathlib; sys.exit(not pathlib.Path(sys.argv[1]).is_file())"
    cpu_native.build_library(tmp_path / "cpu-other", [], [], [], passes)
    assert (tmp_path / "cpu-other" / f"{cpu_native.LIBRARY}.so").is_file()


def test_environments_torch_versions_and_flags_build_apart(monkeypatch):
    here = build_folder("AVX2", ["-O3"])
    assert build_folder("AVX2", ["-O3"]) == here
    assert build_folder("AVX2", ["-O2"]) != here
    assert build_folder("AVX512", ["-O3"]) != here
    monkeypatch.setattr(sys, "prefix", "/elsewhere/venv")
    assert build_folder("AVX2", ["-O3"]) != here
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert build_folder("AVX2", ["-O3"]) != here


@pytest.mark.slow
def test_a_start_while_another_builds_for_too_long_falls_back_and_generates(tmp_path,
                                                                            monkeypatch):
    """A subprocess whose library is not built yet and whose build lock another process
    holds: it waits LATHE_KERNEL_BUILD_WAIT seconds, warns once, and the engine generates
    on the references."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "LATHE_KERNEL_BUILD_WAIT": "1"}
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", env["TORCH_EXTENSIONS_DIR"])
    folder = this_build_folder()
    folder.mkdir(parents=True)
    holder = hold_lock(folder / "build.lock")
    try:
        script = (
            "import time, torch, warnings\n"
            "from lathe.serve import LLMEngine, SamplingParams, EngineConfig\n"
            "from lathe.model import ModelConfig, Transformer\n"
            "from lathe.kernels.cpu_native import cpu_kernels_loaded\n"
            "torch.manual_seed(0)\n"
            "model = Transformer(ModelConfig.from_preset('tiny', vocab_size=64, n_layers=1))\n"
            "start = time.monotonic()\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    engine = LLMEngine(model, None, EngineConfig(num_blocks=8))\n"
            "print('seconds', round(time.monotonic() - start, 1))\n"
            "said = [str(w.message) for w in caught if 'did not build or load' in str(w.message)]\n"
            "print('warnings', len(said))\n"
            "print('held', 'still held by pid 4242' in said[0])\n"
            "print('loaded', cpu_kernels_loaded())\n"
            "out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))\n"
            "print('tokens', len(out[0].outputs[0].token_ids))\n")
        result = processes.run([sys.executable, "-c", script], timeout=120, env=env)
    finally:
        holder.kill()
        holder.wait()
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert float(lines["seconds"]) < 10, result.stdout
    assert lines["warnings"] == "1" and lines["held"] == "True"
    assert lines["loaded"] == "False" and lines["tokens"] == "4"


def test_the_published_library_loads_without_taking_the_lock(tmp_path, monkeypatch):
    """Once built, a start only loads: a held build lock does not delay it."""
    if not load_cpu_kernels():
        pytest.skip("the native kernels do not build here")
    folder = this_build_folder()
    assert (folder / f"{cpu_native.LIBRARY}.so").is_file()
    holder = hold_lock(folder / "build.lock")
    try:
        probe = processes.run([sys.executable, "-c", (
            "import time; start = time.monotonic(); "
            "from lathe.kernels.cpu_native import load_cpu_kernels; "
            "print(load_cpu_kernels(), time.monotonic() - start)")], timeout=60)
    finally:
        holder.kill()
        holder.wait()
    loaded, seconds = probe.stdout.split()
    assert loaded == "True" and float(seconds) < 10, probe.stdout


def test_torch_build_locks_left_behind_are_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "py311_cpu" / "fused_adam").mkdir(parents=True)
    (tmp_path / "py311_cpu" / "fused_adam" / "lock").touch()
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").touch()
    assert [p.parent.name for p in cpu_native.stale_torch_build_locks()] == ["cpu_adam",
                                                                            "fused_adam"]
    from lathe.pretrain.runtime.launch import warn_stale_build_locks
    warn_stale_build_locks()
    err = capsys.readouterr().err
    assert "fused_adam/lock exists; torch waits on it before building DeepSpeed's fused_adam" \
        in err and "Delete it unless a build is running now" in err


WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` now fails, as where it is not installed
import torch
from lathe.kernels.dispatch import HAVE_TRITON
from lathe.model import ModelConfig, Transformer
from lathe.serve import EngineConfig, LLMEngine, SamplingParams
assert not HAVE_TRITON
torch.manual_seed(0)
model = Transformer(ModelConfig.from_preset("tiny", vocab_size=64, n_layers=1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ids = torch.randint(0, 64, (2, 16))
losses = []
for _ in range(3):
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
engine = LLMEngine(model.eval(), None, EngineConfig(num_blocks=8))
out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))
print(losses[-1] < losses[0], len(out[0].outputs[0].token_ids), sys.modules["triton"])
"""


@pytest.mark.parametrize("kernels", ["1", "force"])
def test_lathe_trains_and_generates_where_triton_cannot_be_imported(kernels):
    result = processes.run([sys.executable, "-c", WITHOUT_TRITON], timeout=120,
                           env={**os.environ, "LATHE_KERNELS": kernels})
    assert result.stdout.split() == ["True", "4", "None"], result.stdout + result.stderr


def test_a_build_wait_that_is_not_a_number_is_named(monkeypatch):
    from lathe.core.errors import ConfigError
    monkeypatch.setenv("LATHE_KERNEL_BUILD_WAIT", "soon")
    with pytest.raises(ConfigError, match="LATHE_KERNEL_BUILD_WAIT='soon' must be a number"):
        cpu_native._build_wait()
