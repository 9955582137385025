"""Remove ops that do nothing, by letting their readers read the input instead.

* views to the same shape and strides (``view``, ``reshape``, ``_unsafe_view``, ``alias``,
  ``expand`` to its own shape, ``contiguous`` of a contiguous tensor);
* copies that change nothing (``clone``, ``_to_copy`` to the same dtype, device and strides);
* arithmetic identities whose result is the input bit for bit, same dtype and layout: ``x * 1``
  and ``x / 1``, and ``x + 0`` / ``x - 0`` on integers and bools (on floats ``-0.0 + 0`` is
  ``+0.0``, so those stay): a rotary embedding's ``attention_scaling`` of 1.0, a position offset
  of 0.

Only where no node ever writes the input's or the result's storage (so no reader can tell the two
apart, in-place metadata changes included), and the result is not (a view of) a graph output: the
caller must get a new tensor or view, as in eager, never the input itself.
"""

from __future__ import annotations

from ..analysis.values import alias_roots, mutated_alias_roots, output_alias_roots, replace_uses
from ..ir.graph import Graph

VIEW_NOOPS = frozenset(
    {
        "aten::view",
        "aten::reshape",
        "aten::_unsafe_view",
        "aten::alias",
        "aten::expand",
        "aten::contiguous",
    }
)
COPY_NOOPS = frozenset({"aten::clone", "aten::_to_copy"})
_ONE = ("aten::mul.Tensor", "aten::div.Tensor")
_ZERO = ("aten::add.Tensor", "aten::sub.Tensor")


def _identity(node, graph: Graph) -> bool:
    """``node`` is ``x * 1``, ``x / 1``, or ``x +- 0`` on an integer tensor."""
    name = node.op.name
    if name not in _ONE and name not in _ZERO or len(node.args) != 2 or node.kwargs:
        return False
    other = node.args[1]
    if isinstance(other, bool) or not isinstance(other, (int, float)):
        return False
    if name in _ONE:
        return other == 1
    meta = graph.values[node.outputs[0]].meta
    return other == 0 and meta is not None and not meta.dtype.is_floating_point


def remove_noops(graph: Graph) -> Graph:
    facts: tuple[tuple[int, ...], set[int], set[int]] | None = None
    mapping: dict[int, int] = {}
    kept = []
    for node in graph.nodes:
        name = node.op.name
        src = node.args[0] if node.args else None
        candidate = name in VIEW_NOOPS or name in COPY_NOOPS or _identity(node, graph)
        if candidate and hasattr(src, "id") and not node.multi:
            inp, out = mapping.get(src.id, src.id), node.outputs[0]
            a, b = graph.values[inp].meta, graph.values[out].meta
            same = (
                a is not None
                and b is not None
                and a.is_static
                and (
                    (a.shape, a.stride, a.dtype, a.device) == (b.shape, b.stride, b.dtype, b.device)
                )
            )
            if same:
                if facts is None:
                    # The alias analysis walks the whole graph: only for a graph that has a
                    # candidate, once. Nothing edits the graph before the loop ends, so it is
                    # what computing it up front would give.
                    root = alias_roots(graph)
                    facts = root, mutated_alias_roots(graph, root), output_alias_roots(graph, root)
                root, mutated, returned = facts
                written = root[inp] in mutated or root[out] in mutated
                if not written and root[out] not in returned:
                    mapping[out] = inp
                    continue
        kept.append(node)
    graph.nodes = kept
    replace_uses(graph, mapping)
    return graph
