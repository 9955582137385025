"""Structural checks on a :class:`Graph`, run after conversion and after every pass."""

from __future__ import annotations

from .graph import Graph, refs_in


class VerificationError(AssertionError):
    """The graph breaks an IR invariant; the message names the node."""


def verify(graph: Graph) -> Graph:
    """Check that values are defined once, before use, and that outputs are defined.

    Returns the graph unchanged, so a pass pipeline can write ``verify(pass_(g))``.
    """
    n = len(graph.values)
    defined: set[int] = set()

    def define(vid: int, where: str) -> None:
        if not 0 <= vid < n:
            raise VerificationError(f"{where}: value id {vid} is out of range (graph has {n})")
        if vid in defined:
            raise VerificationError(
                f"{where}: value %{vid} ({graph.values[vid].name}) is defined more than once"
            )
        defined.add(vid)

    for vid in graph.inputs:
        define(vid, "input")
    for vid in graph.constants:
        define(vid, "constant")
    for node in graph.nodes:
        for vid in node.input_ids():
            if vid not in defined:
                name = graph.values[vid].name if 0 <= vid < n else "?"
                raise VerificationError(
                    f"node {node.name} ({node.op.name}) uses %{vid} ({name}) before it is defined"
                )
        outputs = node.outputs
        if not outputs:
            raise VerificationError(f"node {node.name} ({node.op.name}) defines no value")
        if not node.multi and len(outputs) != 1:
            raise VerificationError(
                f"node {node.name} has {len(outputs)} outputs but is not marked multi"
            )
        for vid in outputs:
            if vid in defined or not 0 <= vid < n:  # the checks of define(), inline: hot path
                define(vid, f"node {node.name}")
            defined.add(vid)
    for vid in refs_in(graph.output):
        if vid not in defined:
            raise VerificationError(f"graph output %{vid} is never defined")
    return graph
