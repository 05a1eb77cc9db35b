"""The Accelerator a launch asked for, and the proof that it got it.

`accelerate launch` tells the training process what it wants through environment
variables (WORLD_SIZE from torchrun, ACCELERATE_USE_FSDP / ACCELERATE_USE_DEEPSPEED and
their FSDP_* / ACCELERATE_DEEPSPEED_* settings). On CUDA accelerate honours them. On a
CPU-only machine it silently does not (measured with accelerate 1.15): N processes that each
believe they are alone, an FSDP recipe that becomes plain DDP, a DeepSpeed recipe that
fails on its batch-size check. `build_accelerator` bridges that gap — and only on CPU with
more than one process, so it is inert on GPUs:

1. it initializes accelerate's process state as one gloo group (as `--cpu` would, but
   without `--cpu`'s refusal of FSDP and DeepSpeed), which lets accelerate's own DeepSpeed
   branch run;
2. for FSDP, it registers the `FullyShardedDataParallelPlugin` that accelerate builds from
   the FSDP_* variables, which accelerate only attaches for GPU backends.

Whatever the device, `check_launch` then asserts that the distributed type and world size
are the ones requested, so a silent fallback can never pass for the real thing.

Under `accelerate launch` (torchrun) every rank is also tied to the launcher's life: torchrun
starts ranks in sessions of their own, so a launcher killed with SIGKILL (a preemption, an
OOM kill, `kill -9`) would otherwise leave them training on as orphans, writing into the
out_dir that the resumed run is using.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from lathe.kernels.cpu_native import stale_torch_build_locks

_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """The process group accelerate built is not the one the launch config asked for."""


@dataclass(frozen=True)
class Launch:
    distributed_type: DistributedType
    num_processes: int


def requested_launch(env: dict[str, str] | None = None,
                     cuda: bool | None = None) -> Launch:
    """What the launcher asked for, read from the variables `accelerate launch` sets."""
    env = os.environ if env is None else env
    cuda = torch.cuda.is_available() if cuda is None else cuda
    world_size = int(env.get("WORLD_SIZE", "1"))
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        kind = DistributedType.DEEPSPEED
    elif _flag(env, "ACCELERATE_USE_FSDP"):
        kind = DistributedType.FSDP
    elif world_size > 1:
        kind = DistributedType.MULTI_GPU if cuda else DistributedType.MULTI_CPU
    else:
        kind = DistributedType.NO
    return Launch(kind, world_size)


def needs_cpu_bridge(launch: Launch, cuda: bool | None = None) -> bool:
    """True only for a multi-process launch on a machine without CUDA."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return launch.num_processes > 1 and not cuda


def build_accelerator(**kwargs: Any) -> Accelerator:
    """`Accelerator(**kwargs)` for the current launch, bridged on CPU and checked."""
    launch = requested_launch()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_with_launcher()
    if launch.distributed_type is DistributedType.DEEPSPEED:
        warn_stale_build_locks()
    bridge = needs_cpu_bridge(launch)
    if bridge:
        PartialState(cpu=True)  # one gloo group of WORLD_SIZE processes
    accelerator = Accelerator(**kwargs)
    if bridge and launch.distributed_type is DistributedType.FSDP:
        _attach_fsdp_plugin(accelerator)
    check_launch(accelerator, launch)
    return accelerator


def warn_stale_build_locks() -> None:
    """Say so (rank 0) when torch's extension builds, which DeepSpeed's ops go through, will
    wait on a lock file: one left by a killed build makes the start wait forever, silently."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    for lock in stale_torch_build_locks():
        print(f"lathe: warning: {lock} exists; torch waits on it before building DeepSpeed's "
              f"{lock.parent.name} op — forever if the build that left it was killed. Delete "
              "it unless a build is running now.", file=sys.stderr, flush=True)


def exit_with_launcher() -> None:
    """Have the kernel SIGKILL this process when its parent (the launcher) dies (Linux's
    PR_SET_PDEATHSIG; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != launcher:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _attach_fsdp_plugin(accelerator: Accelerator) -> None:
    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state = accelerator.state
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def check_launch(accelerator: Accelerator, launch: Launch) -> None:
    got = Launch(accelerator.distributed_type, accelerator.num_processes)
    if got != launch:
        raise LaunchError(
            f"the launch asked for {launch.distributed_type.value} on {launch.num_processes} "
            f"process(es) but accelerate set up {got.distributed_type.value} on "
            f"{got.num_processes}; check the --config_file given to `accelerate launch` "
            "(and that `accelerate launch` was used for multi-process runs)")


def describe(accelerator: Accelerator) -> dict[str, Any]:
    """The parallel setup in a few plain fields, for logs, summaries and tests."""
    info: dict[str, Any] = {
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "device": str(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
    }
    if accelerator.distributed_type is DistributedType.DEEPSPEED:
        zero = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"]
        info["zero_stage"] = zero["stage"]
    if accelerator.distributed_type is DistributedType.FSDP:
        info["fsdp_version"] = accelerator.state.fsdp_plugin.fsdp_version
    if torch.distributed.is_initialized():
        info["backend"] = torch.distributed.get_backend()
    return info


def _flag(env: dict[str, str], name: str) -> bool:
    return env.get(name, "false").lower() in ("1", "true", "yes")
