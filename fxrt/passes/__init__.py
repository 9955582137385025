"""Graph passes on the fxrt IR and the pass manager.

A pass is a function ``Graph -> Graph`` named with a verb. The manager runs the configured list in
order, runs the verifier after each one (when ``config.verify``), and records each pass's name,
wall time and whether it changed the graph: whether the graph's canonical text
(:func:`~fxrt.ir.graph_to_text`) differs. Printing the whole graph twice per pass cost more than
some passes, so :func:`_changed` finds the answer from a shallow snapshot taken before the pass
instead (see there).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from ..ir import Graph, graph_to_text, verify
from ..ir.graph import Node
from ..ir.printer import format_arg, node_line, value_decl
from .eliminate_common_subexpressions import eliminate_common_subexpressions
from .eliminate_dead_code import eliminate_dead_code
from .fold_constants import DEFAULT_MAX_BYTES, fold_constants
from .remove_noops import remove_noops

PASSES: dict[str, Callable[[Graph], Graph]] = {
    "eliminate_dead_code": eliminate_dead_code,
    "remove_noops": remove_noops,
    "eliminate_common_subexpressions": eliminate_common_subexpressions,
    "fold_constants": fold_constants,
}

# Optimization levels: 0 runs nothing; 1 the cheap clean-ups; 2 (default) adds constant folding.
LEVELS: dict[int, tuple[str, ...]] = {
    0: (),
    1: ("remove_noops", "eliminate_common_subexpressions", "eliminate_dead_code"),
    2: (
        "fold_constants",
        "remove_noops",
        "eliminate_common_subexpressions",
        "eliminate_dead_code",
    ),
}


class PassError(RuntimeError):
    """A graph pass failed; the message names the pass."""


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    changed: bool


def run_passes(
    graph: Graph,
    names: Sequence[str],
    *,
    check: bool = True,
    fold_max_bytes: int | None = None,
    foldable: Collection[int] | None = None,
    on_pass: Callable[[str, Graph], None] | None = None,
) -> tuple[Graph, list[PassRecord]]:
    """Run the named passes in order; return the graph and one record per pass.

    ``foldable`` names the constants ``fold_constants`` may fold through (None: all of them)."""
    records = []
    for name in names:
        fn = PASSES[name]
        before = _Snapshot(graph)
        t0 = time.perf_counter()
        try:
            if name == "fold_constants":
                graph = fold_constants(
                    graph, fold_max_bytes or DEFAULT_MAX_BYTES, foldable=foldable
                )
            else:
                graph = fn(graph)
            if check:
                verify(graph)
        except Exception as e:
            raise PassError(f"fxrt pass {name!r} failed: {type(e).__name__}: {e}") from e
        records.append(PassRecord(name, time.perf_counter() - t0, _changed(before, graph)))
        if on_pass is not None:
            on_pass(name, graph)
    return graph, records


class _Snapshot:
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


def _changed(before: _Snapshot, graph: Graph) -> bool:
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


__all__ = [
    "LEVELS",
    "PASSES",
    "PassError",
    "PassRecord",
    "eliminate_common_subexpressions",
    "eliminate_dead_code",
    "fold_constants",
    "remove_noops",
    "run_passes",
]
