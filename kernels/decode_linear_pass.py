"""The inductor graph pass that moves a compiled CPU decode step's few-row linears onto
lathe's native ops (`lathe.kernels.decode_linear`), one call for the linears that read the
same x.

The pass (`DecodeLinearPass`, inductor's `post_grad_custom_post_pass`, as vLLM installs
its own fusions) rewrites each `mm(x, permute(w, [1, 0]))` of a float32 graph whose x has
at most `MAX_ROWS` rows — what `F.linear` lowers to — into `lathe::decode_linear_cpu`, and
joins the native ops a model's half linears (bf16, fp16) and quantized ones traced to
(`lathe::decode_linear_cpu`, `lathe::decode_linear_int8_cpu`) the same way; the graph then
calls them without Python. `lathe.serve.decode_graph`
installs it on CPU when the native kernels are loaded and `decode_linear` is enabled.
Its own module: it imports inductor (~1.1 s), which eager serving never needs.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from lathe.kernels.decode_linear import GROUP_OPS, INT8_GROUP_OPS, MAX_GROUP, MAX_ROWS


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
    """A 2-d float32 CPU tensor (of at most `rows` rows)."""
    return (isinstance(value, Tensor) and value.dim() == 2 and value.dtype == torch.float32
            and value.device.type == "cpu" and (rows is None or value.shape[0] <= rows))


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default)


def _source(x: torch.fx.Node) -> tuple[torch.fx.Node, tuple[int, ...]]:
    """What a linear's x is a view of, and its shape: F.linear on a 3-d input views it as
    2-d for each linear apart, so linears that read one tensor see different view nodes."""
    shape = tuple(x.meta["val"].shape)
    while x.target in _VIEWS:
        x = x.args[0]
    return x, shape


class _Linear(NamedTuple):
    node: torch.fx.Node  # the mm, or the single native op
    weights: tuple[torch.fx.Node, ...]  # (weight,) or (int8 weight, scale)
    ops: list  # the native ops by group size it joins
    mm: bool  # whether `node` is an mm (not yet a native op)


def _linear(node: torch.fx.Node) -> _Linear | None:
    """`node` as a few-row linear the pass moves or joins, if it is one."""
    if node.target is INT8_GROUP_OPS[0]:  # an int8 weight's, traced as the op
        return _Linear(node, node.args[1:], INT8_GROUP_OPS, False)
    if node.target is GROUP_OPS[0]:  # a half weight's, traced as the op
        return _Linear(node, (node.args[1],), GROUP_OPS, False)
    weight = _linear_weight(node)
    if (weight is not None and _fits(node.args[0].meta.get("val"), MAX_ROWS)
            and _fits(weight.meta.get("val")) and weight.meta["val"].is_contiguous()):
        return _Linear(node, (weight,), GROUP_OPS, True)
    return None


class DecodeLinearPass(CustomGraphPass):
    """Rewrite a graph's few-row float32 linears into `lathe::decode_linear_cpu`, and join
    its half and int8 ones, one call for all the linears of a weight dtype that read the same
    x (vLLM fuses q/k/v and gate/up into one weight for the same reason; here the weights
    stay as they are)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        order = {node: i for i, node in enumerate(graph.nodes)}
        groups: dict[tuple, list[_Linear]] = {}
        for node in graph.nodes:
            linear = _linear(node)
            if linear is not None:
                dtype = getattr(linear.weights[0].meta.get("val"), "dtype", None)
                groups.setdefault((dtype, *_source(node.args[0])), []).append(linear)
        for linears in groups.values():
            first = linears[0].node
            x = first.args[0]  # read now: erasing `first` (the first part's call) clears it
            # the call goes where the group's first linear was: a weight made after it (not
            # a parameter) takes a call of its own
            joined = [linear for linear in linears
                      if all(order[w] < order[first] for w in linear.weights)]
            parts = [joined[i:i + MAX_GROUP] for i in range(0, len(joined), MAX_GROUP)]
            for part in parts + [[linear] for linear in linears if linear not in joined]:
                if len(part) > 1 or part[0].mm:  # else already its own op
                    self._replace(graph, x, part)

    @staticmethod
    def _replace(graph: torch.fx.Graph, x: torch.fx.Node, linears: list[_Linear]) -> None:
        with graph.inserting_before(linears[0].node):
            call = graph.call_function(linears[0].ops[len(linears) - 1],
                                       (x, *[w for linear in linears for w in linear.weights]))
        if len(linears) == 1:
            call.meta.update(linears[0].node.meta)
            linears[0].node.replace_all_uses_with(call)
        else:
            call.meta["val"] = tuple(linear.node.meta["val"] for linear in linears)
            for i, linear in enumerate(linears):
                with graph.inserting_before(linear.node):
                    out = graph.call_function(operator.getitem, (call, i))
                out.meta.update(linear.node.meta)
                linear.node.replace_all_uses_with(out)
        for linear in linears:
            transposed = linear.node.args[1] if linear.mm else None
            graph.erase_node(linear.node)
            if transposed is not None and not transposed.users:
                graph.erase_node(transposed)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
