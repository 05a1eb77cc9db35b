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

import operator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from lathe.kernels.dispatch import opaque_op

# Up to here the native op beats BLAS (MKL) on every layer of the README model on this
# project's 2-core AMD machine: 20-60% of MKL's time at 1-8 rows, 70% at 16 and 80-85% at
# 32 (`python -m lathe.kernels.bench`); at 64 rows they are level
MAX_ROWS = 32


def decode_linear_reference(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """(M, in) rows times each (out_i, in) weight: [(M, out_i)]."""
    return [F.linear(x, weight) for weight in weights]


def _outputs_like(x: Tensor, *weights: Tensor) -> Tensor | tuple[Tensor, ...]:
    outs = tuple(x.new_empty(x.shape[0], weight.shape[0]) for weight in weights)
    return outs[0] if len(outs) == 1 else outs


# one op per group size (inductor's C++ wrapper would call a Tensor[] argument through Python)
_GROUP_OPS = [
    opaque_op("decode_linear_cpu", "(Tensor x, Tensor w0) -> Tensor", None, _outputs_like),
    opaque_op("decode_linear2_cpu", "(Tensor x, Tensor w0, Tensor w1) -> (Tensor, Tensor)",
              None, _outputs_like),
    opaque_op("decode_linear3_cpu",
              "(Tensor x, Tensor w0, Tensor w1, Tensor w2) -> (Tensor, Tensor, Tensor)", None,
              _outputs_like),
]
MAX_GROUP = len(_GROUP_OPS)


def decode_linear_cpu(x: Tensor, weights: list[Tensor]) -> list[Tensor]:
    """The native op for 1 to MAX_GROUP weights that read the same x: [(M, out_i)]."""
    if not 1 <= len(weights) <= MAX_GROUP:
        raise ValueError(f"decode_linear_cpu takes 1 to {MAX_GROUP} weights, got "
                         f"{len(weights)}")
    out = _GROUP_OPS[len(weights) - 1](x, *weights)
    return [out] if len(weights) == 1 else list(out)


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


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default)


def _source(x: torch.fx.Node) -> tuple[torch.fx.Node, tuple[int, ...]]:
    """What an mm's x is a view of, and its shape: F.linear on a 3-d input views it as 2-d
    for each linear apart, so linears that read one tensor see different view nodes."""
    shape = tuple(x.meta["val"].shape)
    while x.target in _VIEWS:
        x = x.args[0]
    return x, shape


class DecodeLinearPass(CustomGraphPass):
    """Rewrite a graph's few-row float32 linears into `lathe::decode_linear_cpu`, one call
    for all the linears that read the same x (vLLM fuses q/k/v and gate/up into one weight
    for the same reason; here the weights stay as they are)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        order = {node: i for i, node in enumerate(graph.nodes)}
        groups: dict[tuple, list[tuple[torch.fx.Node, torch.fx.Node]]] = {}
        for node in graph.nodes:
            weight = _linear_weight(node)
            if weight is None:
                continue
            x = node.args[0]
            if (_fits(x.meta.get("val"), MAX_ROWS) and _fits(weight.meta.get("val"))
                    and weight.meta["val"].is_contiguous()):
                groups.setdefault(_source(x), []).append((node, weight))
        for linears in groups.values():
            first = linears[0][0]
            x = first.args[0]
            # the call goes where the group's first linear was: a weight made after it (not
            # a parameter) takes a call of its own
            joined = [(mm, w) for mm, w in linears if order[w] < order[first]]
            parts = [joined[i:i + MAX_GROUP] for i in range(0, len(joined), MAX_GROUP)]
            for part in parts + [[pair] for pair in linears if pair not in joined]:
                self._replace(graph, x, part)

    @staticmethod
    def _replace(graph: torch.fx.Graph,
                 x: torch.fx.Node, linears: list[tuple[torch.fx.Node, torch.fx.Node]]) -> None:
        with graph.inserting_before(linears[0][0]):
            call = graph.call_function(_GROUP_OPS[len(linears) - 1],
                                       (x, *[w for _, w in linears]))
        if len(linears) == 1:
            call.meta.update(linears[0][0].meta)
            linears[0][0].replace_all_uses_with(call)
        else:
            call.meta["val"] = tuple(mm.meta["val"] for mm, _ in linears)
            for i, (mm, _) in enumerate(linears):
                with graph.inserting_before(mm):
                    out = graph.call_function(operator.getitem, (call, i))
                out.meta.update(mm.meta)
                mm.replace_all_uses_with(out)
        for mm, _ in linears:
            transposed = mm.args[1]
            graph.erase_node(mm)
            if not transposed.users:
                graph.erase_node(transposed)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
