"""`recipes/gpu-smoke.sh` and `recipes/gpu-check.sh` are for a CUDA machine: without one each
says so and exits 2 before touching anything (on a GPU, run them by hand: they are not part
of CI)."""

import sys
from pathlib import Path

import pytest
import torch

from tests import processes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script really runs")
@pytest.mark.parametrize("script", ["gpu-smoke.sh", "gpu-check.sh"])
def test_gpu_scripts_refuse_without_a_gpu(script, tmp_path):
    out = tmp_path / "smoke"
    result = processes.run(["bash", str(ROOT / "recipes" / script)], timeout=60,
                           check=False, env={"OUT": str(out), "PYTHON": sys.executable,
                                             "COMMIT": "0" * 40, "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "needs a CUDA GPU" in result.stderr
    assert not out.exists()
