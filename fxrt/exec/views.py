"""Which views a loop may make inline, on calls that use the arena.

On those calls autograd records nothing, so a view (``view``, ``_unsafe_view``, ``t``,
``transpose``, ``permute``, and ``split``'s pieces) whose values never leave the graph, are never
written and are only read by ops that return fresh results, or by such views, needs no view
tracking: the compiled loop makes it as the op's CPU kernel does (a new TensorImpl on the same
storage, geometry computed from the actual input) without the dispatcher and autograd's view
layer. :func:`inline_views` picks them; :func:`fxrt.exec.program.lower` emits them as VIEW
instructions.
"""

from __future__ import annotations

from typing import Any

from ..ir.graph import Graph, OpKind
from ..ops.aliasing import is_collective, output_aliases

# The views a loop may make inline on calls without autograd (see the module docstring).
INLINE_VIEW_OPS = frozenset(
    {
        "aten::view",
        "aten::_unsafe_view",
        "aten::t",
        "aten::transpose.int",
        "aten::permute",
        "aten::split.Tensor",
    }
)


def inline_views(graph: Graph) -> frozenset[int]:
    """Indices of the view nodes a loop may make inline on calls without autograd: an
    ``INLINE_VIEW_OPS`` call on a CPU tensor whose result is no graph output and whose every
    user either is such a view itself or reads it and returns fresh results without writing
    anything (so the view is never written, returned or kept by a result)."""
    users: dict[int, list[int]] = {}
    for i, node in enumerate(graph.nodes):
        for vid in set(node.input_ids()):
            users.setdefault(vid, []).append(i)
    outputs = set(graph.output_ids())
    chosen: set[int] = set()
    for i in range(len(graph.nodes) - 1, -1, -1):  # users first
        node = graph.nodes[i]
        if node.op.name not in INLINE_VIEW_OPS or node.multi != (
            node.op.name == "aten::split.Tensor"
        ):
            continue
        metas = [graph.values[vid].meta for vid in node.outputs]
        if outputs.intersection(node.outputs) or any(m is None or m.device != "cpu" for m in metas):
            continue
        if all(
            u in chosen or _only_reads(graph, graph.nodes[u])
            for vid in node.outputs
            for u in users.get(vid, ())
        ):
            chosen.add(i)
    return frozenset(chosen)


def _only_reads(graph: Graph, node: Any) -> bool:
    """An ATen call that writes none of its arguments and whose results alias none of them."""
    if node.op.kind is not OpKind.ATEN or is_collective(node.op.name) or node.op.schema.is_mutable:
        return False
    return not any(output_aliases(graph, node))


__all__ = ["INLINE_VIEW_OPS", "inline_views"]
