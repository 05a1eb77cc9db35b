"""lathe's native CPU kernels: the C++ sources in `csrc/`, built on first use with
`torch.utils.cpp_extension` and loaded into the process, where they register CPU
implementations of ops defined in Python: `lathe::paged_decode_cpu`, the weight-only
GEMMs a compiled step calls (`lathe::int8_matmul_cpu_native`, `int4_matmul_cpu_native`),
its few-row float32 and int8 linears (`lathe::decode_linear_cpu`,
`lathe::decode_linear_int8_cpu`), each row's own LoRA adapter (`lathe::lora_bgmv_cpu`),
the greedy pick (`lathe::argmax_cpu`), and the fused element-wise layers of an eager
float32 forward (`lathe::rms_norm_cpu`, `add_rms_norm_cpu`, `swiglu_cpu`, `rope_cpu`),
which the serve engine's forwards take (`native_inference`, `use_native_cpu`).
Their loops run on torch's intra-op threads (OpenMP); a build whose loops come out serial
is warned about.

The build needs what inductor's CPU backend already needs, a C++ compiler (plus ninja), and
takes ~20-90 s once (2 cores). It cannot hang a start:

- The library lives in a folder of its own per build (`TORCH_EXTENSIONS_DIR`, by default
  ~/.cache/torch_extensions, then `lathe/cpu-ISA-KEY`), KEY hashing the Python environment
  (`sys.prefix`), Python, torch, the flags and the sources: two virtual environments, two
  torch versions or two ISAs never rebuild or load each other's library.
- One process builds, under an `flock` on the folder's `build.lock`, which the kernel
  releases when its holder dies however it dies (torch's own lock file, left by a killed
  build, made every later start wait forever). Others wait at most `BUILD_WAIT_SECONDS`
  (600; `LATHE_KERNEL_BUILD_WAIT` overrides it).
- The build happens in a private folder and the library is published by one rename, so
  nobody ever loads half a library.
- Before it is published, a process of its own loads it and calls an op with an input it
  refuses, which must raise: on one GPU machine's toolchain (Ubuntu 24.04's GCC 13.3,
  torch 2.11) every extension built there died of SIGSEGV formatting a TORCH_CHECK
  message, so a refused input would have killed a server instead of failing a request. A
  library that fails this is not used; when it crashed, the verdict is kept in the folder
  (`refused.txt`), so later starts fall back at once instead of building again.
- Failing, or waiting too long, warns once and keeps the PyTorch reference paths;
  `build_status()` says what a start is waiting for meanwhile (the server's /health shows it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from lathe.core.atomic import atomic_file
from lathe.core.errors import ConfigError
from lathe.kernels.dispatch import opaque_op, use_cpu_kernel

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_decode_cpu.cpp", "quant_matmul_cpu.cpp", "decode_linear_cpu.cpp",
                         "argmax_cpu.cpp", "parallel_probe_cpu.cpp", "elementwise_cpu.cpp",
                         "lora_bgmv_cpu.cpp")]

# the intra-op thread that ran each item of a parallel loop over `items`, one item a task
parallel_probe_cpu = opaque_op("parallel_probe_cpu", "(Tensor items) -> Tensor", None,
                               lambda items: items.new_empty(items.numel(), dtype=torch.long))

# the vector ISA torch's own CPU kernels were dispatched to on this machine, as compiler
# flags and the macros that pick ATen's `Vectorized` for it (as inductor's C++ kernels are
# built; AVX2's with F16C, which ATen's half-precision loads use, as AVX-512 implies it);
# -ffast-math lets the loops vectorize and `expf` become libmvec's vector exp
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}

BUILD_WAIT_SECONDS = 600.0  # how long a start waits for another process's build
LIBRARY = "lathe_cpu_kernels"
REFUSED = "refused.txt"  # in a build folder: why its library is not used
PROBE_VERDICT = "argmax_cpu took a float64 input it must refuse"
# run as `python -c ERROR_PATH_PROBE LIBRARY`: exits 0 when a refused input raises
ERROR_PATH_PROBE = f"""
import sys, torch
from lathe.kernels.argmax import argmax_cpu
torch.ops.load_library(sys.argv[1])
try:
    argmax_cpu(torch.zeros(1, 1, dtype=torch.float64))
except RuntimeError:
    sys.exit(0)
sys.exit({PROBE_VERDICT!r})
"""
# the signals of a process that crashed, as opposed to one killed from outside
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGABRT, signal.SIGFPE}

_loaded: bool | None = None  # None: not tried yet
_status: str | None = None  # what loading is busy with, for /health


def load_cpu_kernels() -> bool:
    """Build (at most once per environment) and load the native CPU kernels; whether they
    are loaded. A failed or timed-out build warns once and is not retried in this process."""
    global _loaded, _status
    if _loaded is None:
        isa = torch.backends.cpu.get_cpu_capability()
        # -fopenmp: `at::parallel_for` is an OpenMP loop in the headers, serial in code
        # compiled without it; the library then binds to the libgomp torch has loaded, so
        # it shares torch's threads (and `torch.set_num_threads`)
        cflags = ["-O3", "-ffast-math", "-fopenmp", *_ISA_FLAGS.get(isa, [])]
        try:
            build_library(build_folder(isa, cflags), _SOURCES, cflags, ["-fopenmp"],
                          ERROR_PATH_PROBE)
            _loaded = True
            _check_threads()
        except (RuntimeError, OSError, ImportError, TimeoutError) as error:
            warnings.warn(f"lathe's native CPU kernels did not build or load ({error}); "
                          "CPU decode attention, linears, element-wise layers and greedy picks "
                          "run on their PyTorch references and compiled steps call the "
                          "quantized GEMMs through Python instead", stacklevel=2)
            _loaded = False
        finally:
            _status = None
    return _loaded


def build_status() -> str | None:
    """What `load_cpu_kernels` is waiting for right now (None when it is not running)."""
    return _status


def build_folder(isa: str, cflags: list[str], sources: list[Path] = _SOURCES) -> Path:
    """Where the library built for this environment, torch, ISA, flags and sources lives."""
    key = hashlib.sha256()
    for part in (sys.prefix, sys.version, torch.__version__, isa, *cflags):
        key.update(part.encode() + b"\0")
    for path in sources:
        key.update(path.read_bytes())
    return extensions_root() / "lathe" / \
        f"cpu-{isa.lower().replace(' ', '_')}-{key.hexdigest()[:16]}"


def extensions_root() -> Path:
    """Where torch (and so DeepSpeed) builds C++ extensions, lathe's folder included."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR")
                or Path.home() / ".cache" / "torch_extensions")


def stale_torch_build_locks() -> list[Path]:
    """The `lock` files of torch's own extension builds (DeepSpeed's ops) under
    `extensions_root()`: torch waits before building for as long as one exists, forever
    when the build that made it was killed, without a word."""
    root = extensions_root()
    return sorted(root.glob("*/lock")) + sorted(root.glob("*/*/lock")) if root.is_dir() else []


def build_library(folder: Path, sources: list[Path], cflags: list[str],
                  ldflags: list[str], probe: str | None = None) -> None:
    """Load `folder`'s published library into this process, building it first (once, by
    one process, under `folder/build.lock`) when it is not there; with `probe`, Python code
    run on the built library in a process of its own, which must exit 0 for the library to
    be published (RuntimeError otherwise, now and on every later call)."""
    global _status
    library = folder / f"{LIBRARY}.so"
    if (folder / REFUSED).is_file():
        raise RuntimeError(f"{(folder / REFUSED).read_text().strip()} (delete {folder} to "
                           "build it again)")
    if not library.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with build_lock(folder / "build.lock", _build_wait()):
            if not library.is_file():
                _status = f"building lathe's native CPU kernels into {folder} (once, ~1 min)"
                print(f"lathe: {_status}", file=sys.stderr, flush=True)
                _build(folder, library, sources, cflags, ldflags, probe)
                return  # the build loaded it
    torch.ops.load_library(str(library))


def _build(folder: Path, library: Path, sources: list[Path], cflags: list[str],
           ldflags: list[str], probe: str | None) -> None:
    """Build in a private folder (loading the result), check it with `probe`, then publish
    it by one rename."""
    from torch.utils import cpp_extension

    for leftover in folder.glob("build-*"):  # of builds that died holding the lock
        shutil.rmtree(leftover, ignore_errors=True)
    private = Path(tempfile.mkdtemp(prefix="build-", dir=folder))
    try:
        cpp_extension.load(name=LIBRARY, sources=[str(path) for path in sources],
                           extra_cflags=cflags, extra_ldflags=ldflags,
                           build_directory=str(private), is_python_module=False,
                           verbose=False)
        if probe is not None:
            _check(private / f"{LIBRARY}.so", probe, folder)
        os.replace(private / f"{LIBRARY}.so", library)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _check(built: Path, probe: str, folder: Path) -> None:
    """Run `probe` on `built` in a process of its own and raise if it fails. A crash (a
    fatal signal) or the probe's own verdict is recorded in the folder's REFUSED file: the
    same build would fail again. A kill from outside (the OOM killer), a timeout or an
    import failure is not: the next start builds and checks again."""
    try:
        result = subprocess.run([sys.executable, "-c", probe, str(built)],
                                capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the check of the native CPU kernels built in {folder} gave no "
                           "answer in 300 s") from None
    if result.returncode == 0:
        return
    last = (result.stderr.strip().splitlines() or [""])[-1]
    crashed = -result.returncode in CRASH_SIGNALS
    how = f"killed by signal {-result.returncode}" if result.returncode < 0 else \
        f"exit {result.returncode}: {last}"
    reason = (f"the native CPU kernels built in {folder} failed their check in a process of "
              f"their own ({how}): an op given an input it refuses must raise")
    if crashed or last == PROBE_VERDICT:
        with atomic_file(folder / REFUSED) as tmp:
            tmp.write_text(reason + "\n")
    raise RuntimeError(reason)


def _build_wait() -> float:
    """Seconds a start waits for another process's build (`LATHE_KERNEL_BUILD_WAIT`)."""
    value = os.environ.get("LATHE_KERNEL_BUILD_WAIT", str(BUILD_WAIT_SECONDS))
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"LATHE_KERNEL_BUILD_WAIT={value!r} must be a number of seconds "
                          f"(default {BUILD_WAIT_SECONDS:g}); unset it or give one") from None


@contextlib.contextmanager
def build_lock(path: Path, wait_seconds: float) -> Iterator[None]:
    """Hold an exclusive `flock` on `path`, waiting at most `wait_seconds` (TimeoutError).
    The kernel drops the lock when its holder exits, killed or not, so a dead builder
    never blocks the next one; the holder's pid is written in the file for the message."""
    global _status
    import fcntl

    with open(path, "a+") as handle:
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{path} is still held by pid {holder} after "
                                       f"{wait_seconds:g} s") from None
                _status = (f"waiting for pid {holder} to finish building lathe's native CPU "
                           f"kernels ({path})")
                time.sleep(0.25)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cpu_kernels_loaded() -> bool:
    """Whether `load_cpu_kernels` has loaded them in this process."""
    return bool(_loaded)


_scope = threading.local()


@contextlib.contextmanager
def native_inference() -> Iterator[None]:
    """Let the forwards this thread runs inside the block take the native element-wise ops
    (`use_native_cpu`). The serve engine runs its model calls in it. Everything else keeps
    the references, so the numbers of a training run's evaluations never depend on
    whether its process has built an engine, and loaded the kernels, yet."""
    before = getattr(_scope, "native", False)
    _scope.native = True
    try:
        yield
    finally:
        _scope.native = before


def native_kernel(name: str, tensor: torch.Tensor) -> bool:
    """The one check every native op's caller makes: the library loaded in this process and
    the kernel policy letting `name` take an optimized CPU op for `tensor` (a CPU tensor,
    `name` on, not `LATHE_KERNELS=force`). Each op adds its own shape and dtype rules."""
    return cpu_kernels_loaded() and use_cpu_kernel(name, tensor)


def use_native_cpu(name: str, *tensors: torch.Tensor) -> bool:
    """Whether a call of element-wise kernel `name` on `tensors` takes its native op:
    inside `native_inference`, `native_kernel`, eager (torch.compile fuses the references
    into its own loops), float32 on CPU, and with no gradient to record (the native ops have
    no backward)."""
    return (getattr(_scope, "native", False) and native_kernel(name, tensors[0])
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def native_threads() -> int:
    """How many of torch's intra-op threads a parallel loop of the loaded library runs on."""
    threads = torch.get_num_threads()
    return int(parallel_probe_cpu(torch.empty(4 * threads)).unique().numel())


def _check_threads() -> None:
    if torch.get_num_threads() > 1 and native_threads() == 1:
        warnings.warn("lathe's native CPU kernels were built without OpenMP (the compiler "
                      "did not take -fopenmp), so they run on one thread; build with a "
                      "compiler that supports OpenMP (GCC, or clang with libomp)",
                      stacklevel=3)
