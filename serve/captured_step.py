"""A compiled decode step captured as a CUDA graph and replayed (vLLM's and SGLang's capture
of a compiled model: `torch.cuda.CUDAGraph` over static input buffers, one memory pool shared
by every batch size's graph).

The step is compiled elsewhere — on any thread, ahead of time (`lathe.serve.decode_graph`) —
and captured here, on the thread that will replay it, which runs the compiled step three
times, no compile: a server on CUDA can answer eagerly while its steps compile in the
background and take each graph as it is built.
Capture runs the step twice on a side stream first (kernels loaded, autotuning settled), then
records one call on padding inputs, which write only the KV slabs' scratch slot. A replay
copies its inputs into the recorded ones and returns a copy of the output: the graphs share a
pool, so the next replay of any of them may overwrite the recorded output.

Everything else the step reads is read at the address it had when recorded: parameters and
the KV slabs are written in place by whatever changes them (`LLMEngine.load_weights`, adapter
slots), never reallocated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

WARM_UP_CALLS = 2  # before the capture: the first loads the kernels, the second runs warm


class CapturedStep:
    """`step(*inputs)` recorded once as a CUDA graph, replayed for every later call of the
    same shapes."""

    def __init__(self, step: Callable[..., Tensor], example: tuple[Tensor, ...],
                 pool: tuple[int, int]) -> None:
        self.inputs = tuple(tensor.clone() for tensor in example)
        # streams, capture and replay are the current device's: the step's, whichever the
        # serving thread's current device is
        self.device = example[0].device
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARM_UP_CALLS):
                    step(*self.inputs)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # "thread_local": the thread compiling the other steps may call CUDA meanwhile
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.output = step(*self.inputs)

    def __call__(self, *inputs: Tensor) -> Tensor:
        for recorded, given in zip(self.inputs, inputs, strict=True):
            recorded.copy_(given)
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.output.clone()
