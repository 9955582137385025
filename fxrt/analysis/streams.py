"""Streams in the IR, as facts: which stream each node runs on (:func:`node_streams`) and, for a
graph ordered by its records and waits, how far along every stream each node is known to be
(:func:`stream_clocks`, vector clocks).

**Assignment.** Stream 0 is the caller's stream. Scopes (``scope_enter``/``scope_exit``,
:mod:`fxrt.ops.streams`) nest; a node runs on the stream of the innermost open scope; a
``scope_enter`` is on the stream it opens, a ``scope_exit`` on the one it returns to (what runs
after each). A label names the same stream throughout the graph; a ``scope_enter`` without a
label keeps the current stream.

The pass that inserts missing record/wait pairs
(:func:`fxrt.passes.synchronize_streams.synchronize_streams`), the lifetime planner and the
executors (:mod:`fxrt.exec.streams`) all read these facts; this module imports neither passes nor
executors.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Graph, Node, refs_in
from ..ops import streams as ops

MAIN = 0  # the caller's stream


class StreamError(ValueError):
    """A multi-stream graph that is not ordered (``strict_streams``) or whose scopes do not
    nest."""


@dataclass(frozen=True)
class Streams:
    """The stream of every node: ``labels[s]`` names stream ``s`` (``labels[0]`` is None, the
    caller's stream); ``of[i]`` is node ``i``'s."""

    labels: tuple[str | None, ...]
    of: tuple[int, ...]

    @property
    def multi(self) -> bool:
        return any(s != MAIN for s in self.of)


def has_stream_ops(graph: Graph) -> bool:
    return any(ops.is_stream_op(n.op.name) for n in graph.nodes)


def _label(node: Node) -> str | None:
    keys = node.args[0] if node.args else node.kwargs.get("keys", ())
    values = node.args[1] if len(node.args) > 1 else node.kwargs.get("values", ())
    return ops.stream_label(keys, values)


def node_streams(graph: Graph) -> Streams:
    """The stream of every node (see the module docstring).

    Raises:
        StreamError: a ``scope_exit`` closes no scope.
    """
    labels: list[str | None] = [None]
    index: dict[str, int] = {}
    stack = [MAIN]
    of: list[int] = []
    for node in graph.nodes:
        name = node.op.name
        if name in ops.SCOPE_ENTER:
            label = _label(node)
            s = stack[-1] if label is None else index.setdefault(label, len(labels))
            if s == len(labels):
                labels.append(label)
            stack.append(s)
            of.append(s)
        elif name in ops.SCOPE_EXIT:
            if len(stack) == 1:
                raise StreamError(f"{node.name}: scope_exit without a matching scope_enter")
            stack.pop()
            of.append(stack[-1])
        else:
            of.append(stack[-1])
    return Streams(tuple(labels), tuple(of))


def stream_clocks(graph: Graph, streams: Streams) -> tuple[list[int], list[tuple[int, ...]]]:
    """For a graph whose streams are ordered by its records and waits: per node, its position
    on its stream (1-based) and its stream's vector clock once it ran (``clock[t]``: how many
    nodes of stream ``t`` are known to have run)."""
    n_streams = len(streams.labels)
    clock = [[0] * n_streams for _ in range(n_streams)]
    event_clock: dict[int, tuple[int, ...]] = {}
    seq, after = [0] * len(graph.nodes), [()] * len(graph.nodes)
    for i, node in enumerate(graph.nodes):
        s = streams.of[i]
        if node.op.name in ops.WAIT:
            for ev in refs_in((node.args, node.kwargs)):
                if ev in event_clock:
                    clock[s] = [max(a, c) for a, c in zip(clock[s], event_clock[ev])]
        clock[s][s] += 1
        seq[i] = clock[s][s]
        after[i] = tuple(clock[s])
        if node.op.name in ops.RECORD:
            for ev in node.outputs:
                event_clock[ev] = after[i]
    return seq, after
