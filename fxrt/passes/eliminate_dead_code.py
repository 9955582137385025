"""Dead-code elimination: drop nodes none of whose outputs is read, walking backwards.

Nodes with side effects stay: ops that write an argument (in-place ops, ``copy_`` into an
input), random ops (they advance the generator, so later random draws would change), asserts and
Python fallbacks (opaque).
"""

from __future__ import annotations

from ..analysis.values import has_side_effects
from ..ir.graph import Graph, refs_in


def eliminate_dead_code(graph: Graph) -> Graph:
    live = set(refs_in(graph.output))
    kept = []
    for node in reversed(graph.nodes):
        if has_side_effects(node) or any(v in live for v in node.outputs):
            kept.append(node)
            live.update(node.input_ids())
    graph.nodes = kept[::-1]
    return graph
