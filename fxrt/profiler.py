"""Per-node profiling of fxrt-compiled graphs.

``with fxrt.profile() as prof:`` makes every call of a compiled graph that the same thread makes
inside the block run its loop's instrumented variant (the Python loop's ``run_observed``, the
compiled loop's timed loop), which times each node; the plain loops pay nothing, the choice is
made once per call. Calls that ``__torch_function__`` must see run on the Python loop, as they do
unprofiled. When ``torch.profiler`` is active, nodes also appear as ``record_function`` ranges
in its trace.

``prof.table()`` aggregates per op (or per node), ``prof.export_chrome_trace(path)`` writes a trace
that chrome://tracing and Perfetto open: one complete event per node call, plus one per graph call.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class NodeEvent:
    graph: str
    node: str
    op: str
    start_ns: int
    end_ns: int
    stream: str | None = None  # the label of the stream it ran on; None: the caller's


@dataclass(frozen=True, slots=True)
class CallEvent:
    graph: str
    executor: str
    start_ns: int
    end_ns: int


@dataclass
class Profile:
    """What one ``fxrt.profile()`` block recorded."""

    nodes: list[NodeEvent] = field(default_factory=list)
    calls: list[CallEvent] = field(default_factory=list)

    @property
    def graph_time_ns(self) -> int:
        return sum(c.end_ns - c.start_ns for c in self.calls)

    def aggregate(self, by: str = "op") -> list[tuple[str, int, int]]:
        """(key, calls, total ns) per op (``by="op"``) or per node (``by="node"``), by total."""
        if by not in ("op", "node"):
            raise ValueError(f"by must be 'op' or 'node', got {by!r}")
        acc: dict[str, list[int]] = {}
        for e in self.nodes:
            key = e.op if by == "op" else f"{e.graph}:{e.node} ({e.op})"
            slot = acc.setdefault(key, [0, 0])
            slot[0] += 1
            slot[1] += e.end_ns - e.start_ns
        return sorted(((k, n, t) for k, (n, t) in acc.items()), key=lambda r: -r[2])

    def table(self, top: int = 15, by: str = "op") -> str:
        """The top entries: op (or node), calls, total µs, % of graph time, mean µs."""
        rows = self.aggregate(by)
        total = self.graph_time_ns or 1
        width = max([len(by)] + [len(k) for k, _, _ in rows[:top]])
        lines = [
            f"{by:<{width}}  {'calls':>7}  {'total us':>10}  {'% graph':>7}  {'mean us':>9}",
        ]
        for key, n, t in rows[:top]:
            lines.append(
                f"{key:<{width}}  {n:>7}  {t / 1e3:>10.1f}  {100 * t / total:>6.1f}%  "
                f"{t / n / 1e3:>9.2f}"
            )
        lines.append(
            f"{len(self.calls)} graph calls, {self.graph_time_ns / 1e3:.1f} us in graphs, "
            f"{sum(e.end_ns - e.start_ns for e in self.nodes) / 1e3:.1f} us in nodes"
        )
        return "\n".join(lines)

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write a Chrome trace-event JSON file (chrome://tracing, Perfetto)."""
        t0 = min([c.start_ns for c in self.calls] + [e.start_ns for e in self.nodes], default=0)
        events = [
            {
                "name": f"{c.graph} [{c.executor}]",
                "cat": "fxrt.graph",
                "ph": "X",
                "ts": (c.start_ns - t0) / 1e3,
                "dur": (c.end_ns - c.start_ns) / 1e3,
                "pid": os.getpid(),
                "tid": 0,
            }
            for c in self.calls
        ]
        # One track per stream: tid 1 the caller's, then one per label in order of appearance.
        tracks: dict[str | None, int] = {None: 1}
        for e in self.nodes:
            tracks.setdefault(e.stream, len(tracks) + 1)
        events += [  # names the tracks, when there are several
            {
                "name": "thread_name",
                "cat": "fxrt.track",
                "ph": "M",
                "pid": os.getpid(),
                "tid": tid,
                "args": {"name": "caller's stream" if label is None else f"stream {label}"},
            }
            for label, tid in tracks.items()
            if len(tracks) > 1
        ]
        events += [
            {
                "name": e.node,
                "cat": "fxrt.node",
                "ph": "X",
                "ts": (e.start_ns - t0) / 1e3,
                "dur": (e.end_ns - e.start_ns) / 1e3,
                "pid": os.getpid(),
                "tid": tracks[e.stream],
                "args": {"op": e.op, "graph": e.graph, "stream": e.stream},
            }
            for e in self.nodes
        ]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f)


# Open profile blocks, innermost last, with the thread that opened each: a block records the
# calls its own thread makes (other threads' calls run uninstrumented and unrecorded).
_active: list[tuple[int, Profile]] = []


def active() -> Profile | None:
    """The innermost profile block the current thread opened, or None."""
    tid = threading.get_ident()
    for owner, prof in reversed(_active):
        if owner == tid:
            return prof
    return None


@contextlib.contextmanager
def profile() -> Iterator[Profile]:
    """Profile fxrt-compiled graphs called inside the block, by the thread that opened it.

    Example::

        with fxrt.profile() as prof:
            compiled(x)
        print(prof.table())
        prof.export_chrome_trace("trace.json")
    """
    prof = Profile()
    entry = (threading.get_ident(), prof)
    _active.append(entry)
    _tell_compiled_loop()
    try:
        yield prof
    finally:
        _active.remove(entry)
        _tell_compiled_loop()


def _tell_compiled_loop() -> None:
    """The compiled loop, called directly by torch.compile, hands calls to their CompiledGraph
    (which instruments them) while a block is open."""
    from .exec.native import set_instrumenting

    set_instrumenting(bool(_active))
