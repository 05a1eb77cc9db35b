"""The linear layers of a compiled CPU decode step at a few rows: `lathe::decode_linear_cpu`
(csrc/decode_linear_cpu.cpp) in place of BLAS's GEMM, beside its reference `F.linear`, and
the inductor graph pass that puts it there.

At a few rows BLAS's GEMM costs a fixed ~2 µs a call, most of a small layer's time, and
streams a large weight (the LM head) at a fraction of what two cores read; the native op
takes 20-85% of its time, the less the fewer the rows. The pass (`DecodeLinearPass`,
inductor's `post_grad_custom_post_pass`, as vLLM installs its own fusions) rewrites each
`mm(x, permute(w, [1, 0]))` of a float32 graph whose x has at most `MAX_ROWS` rows — what
`F.linear` lowers to — into the op, which the graph then calls without Python.
`lathe.serve.decode_graph` installs it on CPU when the native kernels are loaded and
`decode_linear` is enabled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from lathe.kernels.dispatch import opaque_op

# Up to here the native op beats BLAS (MKL) on every layer of the README model on this
# project's 2-core AMD machine: 20-60% of MKL's time at 1-8 rows, 70% at 16 and 80-85% at
# 32 (`python -m lathe.kernels.bench`); at 64 rows they are level
MAX_ROWS = 32


def decode_linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    """(M, in) rows times an (out, in) weight: (M, out)."""
    return F.linear(x, weight)


decode_linear_cpu = opaque_op(
    "decode_linear_cpu", "(Tensor x, Tensor weight) -> Tensor", None,
    lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]))


def _linear_weight(node: torch.fx.Node) -> torch.fx.Node | None:
    """The (out, in) weight of `mm(x, permute(weight, [1, 0]))`, when `node` is that mm."""
    if node.target is not torch.ops.aten.mm.default:
        return None
    transposed = node.args[1]
    if not (isinstance(transposed, torch.fx.Node)
            and transposed.target is torch.ops.aten.permute.default
            and list(transposed.args[1]) == [1, 0]):
        return None
    return transposed.args[0]


def _fits(value: object, rows: int | None = None) -> bool:
    return (isinstance(value, Tensor) and value.dim() == 2 and value.dtype == torch.float32
            and value.device.type == "cpu" and (rows is None or value.shape[0] <= rows))


class DecodeLinearPass(CustomGraphPass):
    """Rewrite a graph's few-row float32 linears into `lathe::decode_linear_cpu`."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            weight = _linear_weight(node)
            if weight is None:
                continue
            x = node.args[0]
            if not (_fits(x.meta.get("val"), MAX_ROWS) and _fits(weight.meta.get("val"))
                    and weight.meta["val"].is_contiguous()):
                continue
            with graph.inserting_before(node):
                linear = graph.call_function(decode_linear_cpu, (x, weight))
            linear.meta.update(node.meta)
            node.replace_all_uses_with(linear)
            transposed = node.args[1]
            graph.erase_node(node)
            if not transposed.users:
                graph.erase_node(transposed)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
