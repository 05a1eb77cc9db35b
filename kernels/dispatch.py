"""Which implementation an op runs: the Triton kernel when its tensors are on CUDA and the
kernel is enabled, the PyTorch reference otherwise — except on CPU, where the quantized
matmuls take torch's vectorized int8/int4 GEMMs and the serve engine's forwards take
lathe's native CPU kernels (`lathe.kernels.cpu_native`).

`LATHE_KERNELS=0` turns every kernel off; `LATHE_KERNELS_DISABLE=rms_norm,swiglu` turns off
the ones named; `LATHE_KERNELS=force` runs them on CPU tensors too, which only works under
Triton's interpreter (`TRITON_INTERPRET=1`, how CI tests the model with kernels on). Read at
each call, so tests and benchmarks can flip them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator

import torch

# Whether Triton is installed, without importing it: each op imports its Triton module
# (`<op>_triton.py`) only when a Triton path runs, so lathe imports where it is missing
# (macOS, Windows) and its references and native CPU kernels run there.
HAVE_TRITON = importlib.util.find_spec("triton") is not None

KERNELS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "int8_matmul", "int4_matmul",
           "linear_cross_entropy", "paged_decode", "causal_attention", "decode_linear",
           "argmax")


def kernel_enabled(name: str) -> bool:
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; lathe has {', '.join(KERNELS)}")
    if os.environ.get("LATHE_KERNELS", "1") == "0":
        return False
    disabled = {n.strip() for n in os.environ.get("LATHE_KERNELS_DISABLE", "").split(",")}
    return name not in disabled


def use_triton(name: str, tensor: torch.Tensor) -> bool:
    on_device = tensor.is_cuda or os.environ.get("LATHE_KERNELS") == "force"
    return HAVE_TRITON and on_device and kernel_enabled(name)


def use_cpu_kernel(name: str, tensor: torch.Tensor) -> bool:
    """Whether a CPU tensor may take an optimized CPU op for `name` (torch's quantized GEMMs,
    lathe's native kernels) rather than the reference; `LATHE_KERNELS=force` keeps CPU on
    Triton."""
    return (tensor.device.type == "cpu" and os.environ.get("LATHE_KERNELS") != "force"
            and kernel_enabled(name))


def check_same_dtype(op: str, **tensors: torch.Tensor) -> None:
    """Refuse operands of different dtypes on every device: Triton's `tl.dot` demands it on
    GPU, and checking everywhere lets a CPU test catch what would crash a GPU run."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        got = ", ".join(f"{name} {str(d).removeprefix('torch.')}" for name, d in dtypes.items())
        raise TypeError(f"{op} needs one dtype for {', '.join(dtypes)}; got {got}. Convert them "
                        "where they meet (a KV cache converts into its own dtype)")


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input_precision: fp32 inputs are multiplied in full fp32 ("ieee") so the
    kernels match their fp32 references; TF32 would cost ~1e-3 relative error. Ignored for
    fp16/bf16 inputs, which use the tensor cores either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def tuning_configs(configs: list) -> list:
    """The autotune candidates, cut to the first under Triton's interpreter, where timing
    means nothing and each extra config only slows the tests."""
    return configs[:1] if os.environ.get("TRITON_INTERPRET") == "1" else configs


@contextlib.contextmanager
def kernels_off(*names: str) -> Iterator[None]:
    """Run the block on the PyTorch references of the named kernels (all, when none are
    named), as `LATHE_KERNELS=0` / `LATHE_KERNELS_DISABLE` would; benchmarks compare with it."""
    for name in names:
        kernel_enabled(name)  # refuses unknown names
    key, value = ("LATHE_KERNELS_DISABLE", ",".join(names)) if names else ("LATHE_KERNELS", "0")
    before = os.environ.get(key)
    if names and before:
        value = f"{before},{value}"
    os.environ[key] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


_LIBRARY = torch.library.Library("lathe", "FRAGMENT")


def opaque_op(name: str, schema: str, impl: Callable[..., torch.Tensor] | None,
              fake: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`impl` as the inference op `lathe::name`, which a compiled graph calls whole instead
    of tracing into it (`fake` gives its output's shape). Registered through
    `torch.library.Library` itself: `torch.library.custom_op`'s Python wrapper costs
    ~28 µs a call against ~7 here, which a decode step of a small model pays per layer.
    With `impl` None the op's implementation is native code that registers itself when
    loaded (`lathe.kernels.cpu_native`)."""
    _LIBRARY.define(f"{name}{schema}")
    if impl is not None:
        _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"lathe::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.lathe, name).default
