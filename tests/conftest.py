"""Shared test setup: Triton's CPU interpreter, offline hubs, two threads shared among the
pytest-xdist workers, seeded torch."""

import os

# Must precede any @triton.jit decoration: without it Triton finds "0 active drivers" on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.builders import reset_accelerate  # noqa: E402

# Two intra-op threads, split among the workers: two workers each spinning two OpenMP threads
# on two cores slowed some tests sixfold. The processes a test starts inherit the worker's
# share through OMP_NUM_THREADS (a one-process run would otherwise take both cores beside the
# other worker; torchrun's ranks already take one each). Tests of threaded paths set their
# own count.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, os.cpu_count() or 1) // WORKERS)
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
torch.set_num_threads(THREADS)


@pytest.fixture(scope="session", autouse=True)
def _lathe_cache(tmp_path_factory):
    """lathe's caches (compiled decode steps) in the session's temporary folder, shared by
    its tests and the processes they start, not the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LATHE_CACHE_DIR", str(tmp_path_factory.mktemp("lathe-cache")))
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _kernel_policy():
    """A test that changes the kernel switches (and builds a model, or calls configure)
    leaves the next test the policy it found."""
    from lathe.kernels import dispatch
    saved = dispatch._resolved, list(dispatch._off), dispatch._policy
    yield
    dispatch._resolved, dispatch._off[:], dispatch._policy = saved


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Every in-process training run starts from accelerate's state as a new process would:
    one test's bf16 Accelerator must not leak into the next test's fp32 one."""
    reset_accelerate()
    yield
    reset_accelerate()
