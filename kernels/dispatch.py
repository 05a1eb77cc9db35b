"""Which implementation an op runs: a Triton kernel on CUDA, lathe's native CPU kernel
(or torch's own quantized GEMM) on CPU, or the PyTorch reference — decided by one
`KernelPolicy`, resolved when a model or engine is built (`configure`) from the defaults
table (`lathe.kernels.defaults`, each entry with the measurement behind it) and these
overrides:

- `LATHE_KERNELS=0` turns every kernel off;
- `LATHE_KERNELS_DISABLE=rms_norm,swiglu` turns the named ones off;
- `LATHE_KERNELS_ENABLE=rope,linear_cross_entropy` turns on ones the table leaves off;
- `LATHE_KERNELS=force` runs every Triton kernel, on CPU tensors too, which only works under
  Triton's interpreter (`TRITON_INTERPRET=1`, how CI tests the model with kernels on).

An op asks the resolved policy (`use_triton`, `use_cpu_kernel`), never the environment;
`kernels_off` narrows it for a block, as benchmarks and tests compare with the references.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from lathe.core.errors import ConfigError
from lathe.kernels.defaults import DEFAULTS

# Whether Triton is installed, without importing it: each op imports its Triton module
# (`<op>_triton.py`) only when a Triton path runs, so lathe imports where it is missing
# (macOS, Windows) and its references and native CPU kernels run there.
HAVE_TRITON = importlib.util.find_spec("triton") is not None

KERNELS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "int8_matmul", "int4_matmul",
           "linear_cross_entropy", "paged_decode", "causal_attention", "document_attention",
           "decode_linear", "argmax", "grouped_matmul", "lora_bgmv")
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class KernelPolicy:
    """The kernels that run, per device type; `force`: the CUDA set (every kernel, unless
    disabled) runs as Triton on any device."""

    on: Mapping[str, frozenset[str]]
    force: bool = False

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> KernelPolicy:
        """The defaults table with the `LATHE_KERNELS*` overrides of `env` applied."""
        mode = env.get("LATHE_KERNELS", "1")
        if mode not in ("0", "1", "force"):
            raise ConfigError(f"LATHE_KERNELS={mode!r} must be 1 (the measured defaults), 0 "
                              "(none) or force (every Triton kernel, CPU tensors included)")
        disabled, enabled = (_names(env, key) for key in ("LATHE_KERNELS_DISABLE",
                                                           "LATHE_KERNELS_ENABLE"))
        on = {}
        for device in DEVICES:
            chosen = set(KERNELS) if mode == "force" else {
                name for name in KERNELS
                if (name, device) in DEFAULTS and DEFAULTS[name, device].on} | enabled
            on[device] = frozenset() if mode == "0" else frozenset(chosen - disabled)
        return cls(on, force=mode == "force")

    def without(self, names: tuple[str, ...]) -> KernelPolicy:
        """This policy with `names` (every kernel, when empty) off."""
        off = set(names or KERNELS)
        return KernelPolicy({device: on - off for device, on in self.on.items()}, self.force)

    def enabled(self, name: str, device: str) -> bool:
        return name in self.on[device]


def _names(env: Mapping[str, str], key: str) -> set[str]:
    names = {n.strip() for n in env.get(key, "").split(",") if n.strip()}
    unknown = sorted(names - set(KERNELS))
    if unknown:
        raise ConfigError(f"{key}: unknown kernel(s) {', '.join(unknown)}; lathe has "
                          f"{', '.join(KERNELS)}")
    return names


# Resolved at import too, so that no op resolves it inside a compiled graph's trace.
_resolved = KernelPolicy.from_environment()  # from the environment, at the last configure()
_off: list[tuple[str, ...]] = []  # the kernels_off blocks now open
_policy = _resolved  # what the ops ask: _resolved narrowed by _off


def configure() -> KernelPolicy:
    """Resolve the policy from the table and the environment (a model or engine being
    built calls this); blocks of `kernels_off` still open keep narrowing it."""
    global _resolved
    _resolved = KernelPolicy.from_environment()
    return _apply()


def _apply() -> KernelPolicy:
    global _policy
    policy = _resolved
    for names in _off:
        policy = policy.without(names)
    _policy = policy
    return policy


def policy() -> KernelPolicy:
    """The policy in force."""
    return _policy


def kernel_enabled(name: str, device: str = "cuda") -> bool:
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; lathe has {', '.join(KERNELS)}")
    return policy().enabled(name, device)


def use_triton(name: str, tensor: torch.Tensor) -> bool:
    """Whether a call of `name` on `tensor` takes its Triton kernel."""
    current = policy()
    return HAVE_TRITON and (tensor.is_cuda or current.force) and name in current.on["cuda"]


def use_cpu_kernel(name: str, tensor: torch.Tensor) -> bool:
    """Whether a CPU tensor may take an optimized CPU op for `name` (torch's quantized GEMMs,
    lathe's native kernels) rather than the reference; `LATHE_KERNELS=force` keeps CPU on
    Triton."""
    current = policy()
    return tensor.device.type == "cpu" and not current.force and name in current.on["cpu"]


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
    _off.append(names)
    _apply()
    try:
        yield
    finally:
        _off.remove(names)
        _apply()


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
