"""Whether a stage changed a graph, without printing it: a shallow snapshot taken before the stage.

A graph changed when its canonical text (:func:`~fxrt.ir.graph_to_text`) differs. Printing the
whole graph twice per stage cost more than some passes, so :func:`changed_since` finds the answer
from a :class:`Snapshot` taken by reference before the stage instead: only the lines whose parts
were replaced are printed and compared (see there). The compile pipeline (:mod:`fxrt.pipeline`)
records the answer and verifies only a graph that changed.
"""

from __future__ import annotations

from .graph import Graph, Node
from .printer import format_arg, graph_to_text, node_line, value_decl


class Snapshot:
    """What the text of a graph is made of, taken by reference before a pass: copies of the
    lists a pass may edit in place (values, inputs, constants), and per node the attributes it
    may reassign (a ``Node`` is mutable), as parallel lists. The objects those attributes hold
    are not copied: the passes (and ``replace_uses``) give a node new args, kwargs or outputs
    rather than edit them in place, so an object seen again is unchanged."""

    __slots__ = (
        "values",
        "inputs",
        "constants",
        "ops",
        "args",
        "kwargs",
        "outputs",
        "multi",
        "output",
    )

    def __init__(self, graph: Graph):
        nodes = graph.nodes
        self.values = list(graph.values)
        self.inputs = list(graph.inputs)
        self.constants = list(graph.constants.items())
        self.ops = [n.op for n in nodes]
        self.args = [n.args for n in nodes]
        self.kwargs = [n.kwargs for n in nodes]
        self.outputs = [n.outputs for n in nodes]
        self.multi = [n.multi for n in nodes]
        self.output = graph.output

    def node(self, i: int) -> Node:
        return Node("", self.ops[i], self.args[i], self.kwargs[i], self.outputs[i], self.multi[i])

    def graph(self) -> Graph:
        """The graph as it was, for printing."""
        nodes = [self.node(i) for i in range(len(self.ops))]
        return Graph(list(self.values), list(self.inputs), dict(self.constants), nodes, self.output)


def changed_since(before: Snapshot, graph: Graph) -> bool:
    """Whether ``graph_to_text(graph)`` differs from the text of the graph ``before`` shows,
    without printing either in full.

    A different number of inputs, constants or nodes is a different number of lines: changed.
    Otherwise the texts differ exactly when some line does, and a line whose parts are the very
    same objects as before prints the same; only the lines where some part was replaced are
    printed and compared. A value whose name or type changed may show up in many lines: then
    both graphs are printed in full (no built-in pass renames a value; folding retypes the
    values it folds, but it also removes their nodes, which the line count catches)."""
    nodes = graph.nodes
    if (
        len(before.inputs) != len(graph.inputs)
        or len(before.constants) != len(graph.constants)
        or len(before.ops) != len(nodes)
    ):
        return True
    values = graph.values
    if len(before.values) != len(values) or any(
        a is not b and (a.id, a.name, value_decl(a)) != (b.id, b.name, value_decl(b))
        for a, b in zip(before.values, values)
    ):
        return graph_to_text(before.graph()) != graph_to_text(graph)
    # Every value prints as before from here on: one name table serves both graphs.
    names: dict[int, str] = {}

    def names_() -> dict[int, str]:
        if not names:
            names.update((v.id, v.name) for v in values)
        return names

    if before.inputs != graph.inputs:
        old = [value_decl(values[v]) for v in before.inputs]
        if old != [value_decl(values[v]) for v in graph.inputs]:
            return True
    for (vid, c), (new_vid, new_c) in zip(before.constants, graph.constants.items()):
        if vid == new_vid and c is new_c:
            continue
        old_line = f"{value_decl(values[vid])} = constant {format_arg(c)}"
        if old_line != f"{value_decl(values[new_vid])} = constant {format_arg(new_c)}":
            return True
    for i, (op, args, kwargs, outputs, node) in enumerate(
        zip(before.ops, before.args, before.kwargs, before.outputs, nodes)
    ):
        if (
            op is node.op
            and args is node.args
            and kwargs is node.kwargs
            and outputs is node.outputs
            and before.multi[i] == node.multi
        ):
            continue
        old = node_line(before.node(i), values, names_())
        if old != node_line(node, values, names_()):
            return True
    if before.output is not graph.output:
        return format_arg(before.output, names_()) != format_arg(graph.output, names_())
    return False


__all__ = ["Snapshot", "changed_since"]
