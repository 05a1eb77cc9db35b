"""`recipes/gpu-smoke.sh` is for a CUDA machine: without one it says so and exits 2 before
touching anything (on a GPU, run it by hand: it is not part of CI)."""

import sys
from pathlib import Path

import pytest
import torch

from tests import processes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script really runs")
def test_gpu_smoke_refuses_without_a_gpu(tmp_path):
    out = tmp_path / "smoke"
    result = processes.run(["bash", str(ROOT / "recipes" / "gpu-smoke.sh")], timeout=60,
                           check=False, env={"OUT": str(out), "PYTHON": sys.executable,
                                             "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs a CUDA GPU" in result.stderr
    assert not out.exists()
