"""The happens-before verifier that inserts the record/wait pairs a multi-stream graph is
missing, and the pass that removes the stream ops (``streams="off"``).

Which stream each node runs on is a fact of the IR (:func:`fxrt.analysis.streams.node_streams`,
with the assignment rules), read here as by the planner and the executors.

**Happens-before** (:func:`synchronize_streams`). Program order is one valid schedule; on
several streams, a node is ordered after another on its own stream that precedes it, and after a
node on another stream only through a ``record`` (on the producer's stream, after it) and a
``wait`` on that event (on the consumer's stream, before it). The check keeps one vector clock
per stream (how far into every stream it is known to be) and, per alias set (views share their
base's), the last node that made or wrote it and the nodes that read it since. A node must be
ordered after the node that made each value it reads (its register) and the last writer of every
set it reads or writes (read after write) and, when it writes, after every reader since (write
after read). The graph's inputs and constants are ready
on every stream: each side stream starts after the caller's stream at the call's start.

A missing order is inserted (a ``record`` right after the producer, a ``wait`` right before the
consumer, one per consumer for all it misses) and logged on the ``fxrt.streams`` logger; with
``strict`` it is a :class:`StreamError` naming both nodes. Last, every side stream joins the
caller's stream at the end of the graph (``record`` on it, ``wait`` on stream 0), so outputs are
complete and every buffer's uses are done when the call returns. A graph without stream ops is
returned unchanged; one whose ops all run on stream 0 needs nothing either.

Only :mod:`fxrt.analysis` facts are used: passes never import the executors.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..analysis.streams import (
    MAIN,
    StreamError,
    Streams,
    has_stream_ops,
    node_streams,
    stream_clocks,
)
from ..analysis.values import alias_roots, unique_name, written_values
from ..ir.graph import Graph, Node, Op, Ref, TensorMeta, ValueKind, refs_in
from ..ops import streams as ops

log = logging.getLogger("fxrt.streams")

_TOKEN_META = TensorMeta((0,), (1,), torch.float32, "cpu", 0)


class _Builder:
    """Makes the stream-op nodes the verifier inserts."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.taken = {n.name for n in graph.nodes} | {v.name for v in graph.values}

    def node(self, base: str, target: Any, args: tuple, kind: ValueKind) -> Node:
        name = unique_name(self.taken, base)
        meta = _TOKEN_META if kind is ValueKind.TENSOR else None
        vid = self.graph.add_value(name, kind, meta)
        return Node(name, Op.of(target), args, {}, [vid])

    def record(self) -> Node:
        return self.node("record", ops.record_op, (), ValueKind.TENSOR)

    def wait(self, events: list[int]) -> Node:
        return self.node("wait", ops.wait_op, ([Ref(e) for e in events],), ValueKind.NONE)

    def enter(self, label: str) -> Node:
        return self.node("scope_enter", ops.scope_enter, ([ops.LABEL_KEY], [label]), ValueKind.NONE)

    def exit(self) -> Node:
        return self.node("scope_exit", ops.scope_exit, (), ValueKind.NONE)


def synchronize_streams(graph: Graph, strict: bool = False, log_inserted: bool = True) -> Graph:
    """Check that every cross-stream use is ordered, insert what is missing (or raise with
    ``strict``), close scopes left open and join the side streams at the end (see the module
    docstring). Edits ``graph`` in place and returns it."""
    if not has_stream_ops(graph):
        return graph
    streams = node_streams(graph)
    nodes = graph.nodes
    n_streams = len(streams.labels)
    root = alias_roots(graph)
    clock = [[0] * n_streams for _ in range(n_streams)]  # per stream: what it has seen of each
    seq = [0] * len(nodes)  # a node's position on its stream (1-based)
    after: list[tuple[int, ...]] = [()] * len(nodes)  # its stream's clock once it ran
    event_clock: dict[int, tuple[int, ...]] = {}  # event token value -> clock it marks
    maker: dict[int, int] = {}  # value -> node that made it (the register's writer)
    writer: dict[int, int] = {}  # alias root -> node that made or last wrote its storage
    readers: dict[int, dict[int, int]] = {}  # alias root -> stream -> last reader since writer
    events = {vid for n in nodes if n.op.name in ops.RECORD for vid in n.outputs}
    b = _Builder(graph)
    record_after: dict[int, Node] = {}  # node index -> the record inserted right after it
    wait_before: dict[int, Node] = {}  # node index -> the wait inserted right before it

    def ordered(s: int, j: int) -> bool:
        return streams.of[j] == s or clock[s][streams.of[j]] >= seq[j]

    for i, node in enumerate(nodes):
        s = streams.of[i]
        name = node.op.name
        if name in ops.WAIT:
            for ev in refs_in((node.args, node.kwargs)):
                if ev not in event_clock:
                    raise StreamError(
                        f"{node.name}: waits for %{graph.values[ev].name}, not an event"
                    )
                clock[s] = [max(a, c) for a, c in zip(clock[s], event_clock[ev])]
        elif not ops.is_stream_op(name):
            reads = [v for v in node.input_ids() if v not in events]
            writes = written_values(node)
            missing: list[int] = []
            for v in reads + writes:
                for w in (maker.get(v), writer.get(root[v])):
                    if w is not None and not ordered(s, w) and w not in missing:
                        missing.append(w)
            for v in writes:
                for t, r in readers.get(root[v], {}).items():
                    if t != s and not ordered(s, r) and r not in missing:
                        missing.append(r)
            if missing:
                _missing(graph, streams, missing, i, strict, log_inserted)
                # One event per stream: the record after its latest node covers the earlier ones.
                latest: dict[int, int] = {}
                for j in missing:
                    t = streams.of[j]
                    if t not in latest or seq[j] > seq[latest[t]]:
                        latest[t] = j
                evs = []
                for j in latest.values():
                    rec = record_after.get(j)
                    if rec is None:
                        rec = record_after[j] = b.record()
                    evs.append(rec.outputs[0])
                    clock[s] = [max(a, c) for a, c in zip(clock[s], after[j])]
                wait_before[i] = b.wait(evs)
            for v in reads:
                readers.setdefault(root[v], {})[s] = i
            for v in writes:
                writer[root[v]] = i
                readers[root[v]] = {}
            for v in node.outputs:
                maker[v] = i
                if root[v] == v:
                    writer[v] = i
                    readers[v] = {}
        clock[s][s] += 1
        seq[i] = clock[s][s]
        after[i] = tuple(clock[s])
        if name in ops.RECORD:
            for ev in node.outputs:
                event_clock[ev] = after[i]

    out: list[Node] = []
    for i, node in enumerate(nodes):
        if i in wait_before:
            out.append(wait_before[i])
        out.append(node)
        if i in record_after:
            out.append(record_after[i])
    # Close the scopes left open, then join every side stream that ran something the caller's
    # stream has not waited for.
    depth = 0
    for node in nodes:
        if node.op.name in ops.SCOPE_ENTER:
            depth += 1
        elif node.op.name in ops.SCOPE_EXIT:
            depth -= 1
    out.extend(b.exit() for _ in range(depth))
    last = {}
    for i, s in enumerate(streams.of):
        if s != MAIN and not ops.is_stream_op(nodes[i].op.name):
            last[s] = seq[i]
    joins = []
    for s, n in sorted(last.items()):
        if clock[MAIN][s] < n:
            rec = b.record()
            out.extend((b.enter(streams.labels[s]), rec, b.exit()))
            joins.append(rec.outputs[0])
    if joins:
        out.append(b.wait(joins))
        log.debug("joined streams %s at the end", [streams.labels[s] for s in last])
    graph.nodes = out
    return graph


def _missing(
    graph: Graph, streams: Streams, missing: list[int], i: int, strict: bool, log_inserted: bool
) -> None:
    node = graph.nodes[i]
    for j in missing:
        what = (
            f"{node.name} (stream {_show(streams, i)}) uses what {graph.nodes[j].name} "
            f"(stream {_show(streams, j)}) makes or reads with no record/wait ordering them"
        )
        if strict:
            raise StreamError(f"fxrt: strict_streams: {what}")
        log.log(
            logging.INFO if log_inserted else logging.DEBUG,
            "fxrt: inserted a record/wait: %s",
            what,
        )


def _show(streams: Streams, i: int) -> str:
    label = streams.labels[streams.of[i]]
    return "of the caller" if label is None else repr(label)


__all__ = [
    "MAIN",
    "StreamError",
    "Streams",
    "has_stream_ops",
    "node_streams",
    "remove_streams",
    "stream_clocks",
    "synchronize_streams",
]


def remove_streams(graph: Graph) -> Graph:
    """Every op on the caller's stream: the stream ops removed (``streams="off"``). An event's
    reader other than a wait keeps the record that makes it."""
    if not has_stream_ops(graph):
        return graph
    kept = []
    for node in graph.nodes:
        name = node.op.name
        if name in ops.SCOPE_ENTER or name in ops.SCOPE_EXIT or name in ops.WAIT:
            continue
        kept.append(node)
    used = {v for n in kept for v in n.input_ids()} | set(refs_in(graph.output))
    graph.nodes = [n for n in kept if n.op.name not in ops.RECORD or used & set(n.outputs)]
    return graph
