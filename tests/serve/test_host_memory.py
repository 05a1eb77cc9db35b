"""With freed memory retained, a loop that allocates and frees a step's large temporaries
stops page-faulting after its first passes; with glibc's initial mmap threshold (128 KiB,
fixed here: how far glibc has raised it by a given step varies from run to run) it faults
every pass."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lathe.serve.host_memory import retain_freed_memory

LOOP = """
import ctypes, resource, sys
import torch
from lathe.serve.host_memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory()
else:
    assert ctypes.CDLL(None).mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
def step():  # a prefill's activations (512 x 352 floats each), alive together, then freed
    alive = [torch.ones(180_224) for _ in range(12)]
    del alive
for _ in range(3):  # the heap grows to what a step needs over its first passes
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", LOOP, mode], capture_output=True, text=True,
                          timeout=120, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not retain_freed_memory(), reason="needs glibc's malloc (mallopt)")
def test_retained_memory_stops_the_page_faults_of_repeated_temporaries():
    assert faults("mmap") > 20_000  # 8.3 MiB of pages, faulted in again each pass
    assert faults("retain") < 1_000
    assert retain_freed_memory()  # set once, and says so again


ENGINE = """
import sys
from lathe.serve import host_memory
from lathe.serve.engine import EngineConfig, LLMEngine
from lathe.serve.sampling import SamplingParams
from tests.builders import serve_model
engine = LLMEngine(serve_model(), config=EngineConfig(
    num_blocks=16, retain_freed_memory=sys.argv[1] == "retain"))
engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
print(host_memory._retained)
"""


def test_an_engine_inside_a_training_process_leaves_malloc_alone():
    """A training stage's evaluation engine (`retain_freed_memory=False`) must not make the
    process keep its freed activations for good; a serving engine does."""
    runs = {mode: subprocess.run([sys.executable, "-c", ENGINE, mode], capture_output=True,
                                 text=True, timeout=120, check=True).stdout.split()[-1]
            for mode in ("retain", "leave")}
    assert runs == {"retain": str(retain_freed_memory()), "leave": "False"}
