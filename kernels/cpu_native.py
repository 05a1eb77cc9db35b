"""lathe's native CPU kernels: the C++ sources in `csrc/`, built on first use with
`torch.utils.cpp_extension` and loaded into the process, where they register CPU
implementations of ops defined in Python: `lathe::paged_decode_cpu`, the weight-only
GEMMs a compiled step calls (`lathe::int8_matmul_cpu_native`, `int4_matmul_cpu_native`),
its few-row float32 and int8 linears (`lathe::decode_linear_cpu`,
`lathe::decode_linear_int8_cpu`), the greedy pick (`lathe::argmax_cpu`), and the fused
element-wise layers of an eager float32 forward (`lathe::rms_norm_cpu`,
`add_rms_norm_cpu`, `swiglu_cpu`, `rope_cpu`), which the serve engine's forwards take
(`native_inference`, `use_native_cpu`).
Their loops run on torch's intra-op threads (OpenMP); a build whose loops come out serial
is warned about.

The build needs what inductor's CPU backend already needs, a C++ compiler (plus ninja), and
takes ~20 s once (2 cores): torch caches it per machine (`TORCH_EXTENSIONS_DIR`, by default
~/.cache/torch_extensions), under a name carrying the CPU capability it was compiled for,
so a cache shared by machines of different ISAs never loads code a CPU cannot run. When
the build fails the caller is warned once and keeps the PyTorch reference paths.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from lathe.kernels.dispatch import opaque_op, use_cpu_kernel

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_decode_cpu.cpp", "quant_matmul_cpu.cpp", "decode_linear_cpu.cpp",
                         "argmax_cpu.cpp", "parallel_probe_cpu.cpp", "elementwise_cpu.cpp")]

# the intra-op thread that ran each item of a parallel loop over `items`, one item a task
parallel_probe_cpu = opaque_op("parallel_probe_cpu", "(Tensor items) -> Tensor", None,
                               lambda items: items.new_empty(items.numel(), dtype=torch.long))

# the vector ISA torch's own CPU kernels were dispatched to on this machine, as compiler
# flags and the macros that pick ATen's `Vectorized` for it (as inductor's C++ kernels are
# built); -ffast-math lets the loops vectorize and `expf` become libmvec's vector exp
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}

_loaded: bool | None = None  # None: not tried yet


def load_cpu_kernels() -> bool:
    """Build (at most once per machine) and load the native CPU kernels; whether they are
    loaded. A failed build warns once and is not retried in this process."""
    global _loaded
    if _loaded is None:
        from torch.utils import cpp_extension

        isa = torch.backends.cpu.get_cpu_capability()
        try:
            cpp_extension.load(
                name=f"lathe_cpu_kernels_{isa.lower().replace(' ', '_')}",
                sources=[str(path) for path in _SOURCES],
                # -fopenmp: `at::parallel_for` is an OpenMP loop in the headers, serial in
                # code compiled without it; the library then binds to the libgomp torch
                # has loaded, so it shares torch's threads (and `torch.set_num_threads`)
                extra_cflags=["-O3", "-ffast-math", "-fopenmp", *_ISA_FLAGS.get(isa, [])],
                extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
            _loaded = True
            _check_threads()
        except (RuntimeError, OSError, ImportError) as error:
            warnings.warn(f"lathe's native CPU kernels did not build or load ({error}); "
                          "CPU decode attention, linears, element-wise layers and greedy picks "
                          "run on their PyTorch references and compiled steps call the "
                          "quantized GEMMs through Python instead", stacklevel=2)
            _loaded = False
    return _loaded


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


def use_native_cpu(name: str, *tensors: torch.Tensor) -> bool:
    """Whether a call of kernel `name` on `tensors` takes its native op: inside
    `native_inference`, with the kernels loaded and `name` enabled, eager (torch.compile
    fuses the references into its own loops), float32 on CPU, and with no gradient to record
    (the native ops have no backward)."""
    return (getattr(_scope, "native", False) and cpu_kernels_loaded()
            and use_cpu_kernel(name, tensors[0])
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
