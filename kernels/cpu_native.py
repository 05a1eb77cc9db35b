"""lathe's native CPU kernels: the C++ sources in `csrc/`, built on first use with
`torch.utils.cpp_extension` and loaded into the process, where they register CPU
implementations of ops defined in Python: `lathe::paged_decode_cpu`, the weight-only
GEMMs a compiled step calls (`lathe::int8_matmul_cpu_native`, `int4_matmul_cpu_native`)
and its few-row linears (`lathe::decode_linear_cpu`).

The build needs what inductor's CPU backend already needs, a C++ compiler (plus ninja), and
takes ~20 s once (2 cores): torch caches it per machine (`TORCH_EXTENSIONS_DIR`, by default
~/.cache/torch_extensions), under a name carrying the CPU capability it was compiled for,
so a cache shared by machines of different ISAs never loads code a CPU cannot run. When
the build fails the caller is warned once and keeps the PyTorch reference paths.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_decode_cpu.cpp", "quant_matmul_cpu.cpp", "decode_linear_cpu.cpp")]

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
                extra_cflags=["-O3", "-ffast-math", *_ISA_FLAGS.get(isa, [])],
                is_python_module=False, verbose=False)
            _loaded = True
        except (RuntimeError, OSError, ImportError) as error:
            warnings.warn(f"lathe's native CPU kernels did not build or load ({error}); "
                          "CPU decode attention runs on its PyTorch reference (gather + "
                          "SDPA) and compiled steps call the quantized GEMMs through Python "
                          "instead", stacklevel=2)
            _loaded = False
    return _loaded


def cpu_kernels_loaded() -> bool:
    """Whether `load_cpu_kernels` has loaded them in this process."""
    return bool(_loaded)
