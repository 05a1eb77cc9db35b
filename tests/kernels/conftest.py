"""The native CPU kernels' tests (marked `native_cpu`): skipped where there is no C++
compiler, and run with the kernels built and loaded (once a process), which must work."""

import shutil

import pytest

from lathe.kernels.cpu_native import load_cpu_kernels


@pytest.fixture(autouse=True)
def _native_kernels(request):
    if request.node.get_closest_marker("native_cpu") is None:
        return
    if shutil.which("c++") is None:
        pytest.skip("the native kernels need a C++ compiler")
    assert load_cpu_kernels(), "the native CPU kernels did not build"
