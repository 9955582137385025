"""Multi-stream programs: what planning, the arena and lowering need to know about streams.

A graph with stream ops (:mod:`fxrt.ops.streams`) has been ordered by
:func:`fxrt.passes.synchronize_streams.synchronize_streams`: every cross-stream use follows a
record and a wait, and the side streams join the caller's at the end. Here:

* **Frees** (:func:`free_points`). A buffer used on one stream is freed after its last use, as
  without streams. One used on several is freed on the stream that made it (whose pool its
  memory returns to, on a device's caching allocator), at the first node of that stream ordered
  after every use on the others (vector clocks, :func:`fxrt.analysis.streams.stream_clocks`); when
  there is none, at the graph's end, after the final join. Never earlier than every use.
* **Arena** (:func:`shared_values`). The arena reuses bytes between values whose node intervals
  do not overlap, which only orders them on one stream. A value a side stream touches gets no
  bytes another value uses (its slot is busy over the whole program).
* **Lowering** (:func:`stream_table`). Scope ops become STREAM instructions (the stream the
  next instructions run on), records and waits RECORD and WAIT on dense event numbers; a WAIT
  also lists the registers made on other streams that its stream reads after it, which a device
  executor protects as ``record_stream`` does. :class:`StreamTable` says how many streams and
  events there are and on which device: ``cpu`` runs each side stream on a worker thread,
  another device on its own ``c10::Stream``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..analysis.streams import MAIN, has_stream_ops, node_streams, stream_clocks
from ..ir.graph import Graph, ValueKind, refs_in
from ..ops import streams as ops


@dataclass(frozen=True)
class StreamTable:
    """The streams of a Program: ``labels[s]`` (``labels[0]`` is None, the caller's stream),
    ``device`` (a device type: ``cpu`` means worker threads) and the number of events a call
    records."""

    labels: tuple[str | None, ...]
    device: str
    n_events: int

    def text(self) -> str:
        names = ", ".join(
            f"{s} {'caller' if label is None else repr(label)}"
            for s, label in enumerate(self.labels)
        )
        how = "worker threads" if self.device == "cpu" else f"{self.device} streams"
        return f"streams {names} ({how}), {self.n_events} events"


def free_points(
    graph: Graph, members: dict[int, list[int]], ends: dict[int, int]
) -> dict[int, int]:
    """Per alias root, the node after which the set is freed, for a multi-stream graph (see the
    module docstring); ``ends`` are the last uses in program order."""
    streams = node_streams(graph)
    if not streams.multi:
        return ends
    seq, after = stream_clocks(graph, streams)
    users: dict[int, set[int]] = {}
    maker: dict[int, int] = {}
    root_of = {v: r for r, vs in members.items() for v in vs}
    for i, node in enumerate(graph.nodes):
        for v in node.input_ids():
            if v in root_of:
                users.setdefault(root_of[v], set()).add(i)
        for v in node.outputs:
            if v in root_of:
                users.setdefault(root_of[v], set()).add(i)
                maker.setdefault(root_of[v], i)
    n = len(graph.nodes)
    by_stream: dict[int, list[int]] = {}
    for i, s in enumerate(streams.of):
        by_stream.setdefault(s, []).append(i)
    out = dict(ends)
    for root, end in ends.items():
        used = users.get(root, set())
        on = {streams.of[i] for i in used}
        if len(on) <= 1:
            continue
        home = streams.of[maker[root]] if root in maker else MAIN
        point = n - 1
        for k in by_stream[home]:
            if k < end:
                continue
            if all(
                streams.of[u] == home and u <= k or after[k][streams.of[u]] >= seq[u] for u in used
            ):
                point = k
                break
        out[root] = point
    return out


def shared_values(graph: Graph) -> frozenset[int]:
    """Values a side stream makes or reads (and their alias sets' members are the caller's
    concern): the arena keeps their bytes to themselves."""
    if not has_stream_ops(graph):
        return frozenset()
    streams = node_streams(graph)
    found: set[int] = set()
    for i, node in enumerate(graph.nodes):
        if streams.of[i] != MAIN:
            found.update(node.input_ids())
            found.update(node.outputs)
    return frozenset(found)


def graph_device(graph: Graph) -> str:
    """The device type most of the graph's tensors are on (``cpu`` on a tie or without any)."""
    count = Counter(
        v.meta.device.split(":")[0]
        for v in graph.values
        if v.kind is ValueKind.TENSOR and v.meta is not None
    )
    if not count:
        return "cpu"
    return max(count, key=lambda d: (count[d], d == "cpu"))


@dataclass(frozen=True)
class StreamStep:
    """What one stream-op node lowers to: ``kind`` STREAM (``stream`` is the one it switches
    to), RECORD (``events[0]`` its event) or WAIT (``events``; ``protect``: registers made on
    other streams that its stream reads after it)."""

    kind: str
    stream: int
    events: tuple[int, ...] = ()
    protect: tuple[int, ...] = ()


def stream_table(graph: Graph) -> tuple[StreamTable, dict[int, StreamStep]] | None:
    """The Program's stream table and, per stream-op node index, its instruction; None for a
    graph without stream ops."""
    if not has_stream_ops(graph):
        return None
    streams = node_streams(graph)
    event_of: dict[int, int] = {}
    steps: dict[int, StreamStep] = {}
    maker: dict[int, int] = {}  # value -> stream that made it
    last_wait: dict[int, int] = {}  # stream -> index of its latest WAIT
    protect: dict[int, list[int]] = {}
    inputs = set(graph.inputs) | set(graph.constants)
    stack = [MAIN]
    for i, node in enumerate(graph.nodes):
        s = streams.of[i]
        name = node.op.name
        if name in ops.SCOPE_ENTER:
            stack.append(s)
            steps[i] = StreamStep("STREAM", s)
        elif name in ops.SCOPE_EXIT:
            stack.pop()
            steps[i] = StreamStep("STREAM", stack[-1])
        elif name in ops.RECORD:
            event_of[node.outputs[0]] = len(event_of)
            steps[i] = StreamStep("RECORD", s, (event_of[node.outputs[0]],))
        elif name in ops.WAIT:
            evs = tuple(event_of[e] for e in refs_in((node.args, node.kwargs)))
            steps[i] = StreamStep("WAIT", s, evs)
            last_wait[s] = i
            protect[i] = []
        else:
            for v in node.input_ids():
                if v in inputs or maker.get(v, s) == s or s not in last_wait:
                    continue
                regs = protect[last_wait[s]]
                if v not in regs and graph.values[v].kind is ValueKind.TENSOR:
                    regs.append(v)
        for v in node.outputs:
            maker.setdefault(v, s)
    for i, regs in protect.items():
        st = steps[i]
        steps[i] = StreamStep(st.kind, st.stream, st.events, tuple(regs))
    table = StreamTable(streams.labels, graph_device(graph), len(event_of))
    return table, steps


def node_stream_labels(program) -> dict[int, str]:
    """Node index -> the label of the side stream its instruction runs on (the caller's stream's
    nodes are left out), read off the program's STREAM instructions: the profiler's tracks."""
    if program.streams is None:
        return {}
    labels = program.streams.labels
    out: dict[int, str] = {}
    current = MAIN
    for ins in program.code:
        kind = getattr(ins, "KIND", "")
        if kind == "STREAM":
            current = ins.stream
        elif kind != "FREE" and current != MAIN:
            out[ins.node] = labels[current]
    return out


__all__ = [
    "StreamStep",
    "StreamTable",
    "free_points",
    "graph_device",
    "node_stream_labels",
    "shared_values",
    "stream_table",
]
