"""Measured memory: replay a Program and record the bytes its intermediates actually hold.

After each node runs (before the FREEs that follow it), the registers are scanned for tensors; each
distinct storage that does not belong to a graph input or constant counts once with its size. The
plan's prediction (``Plan.live_bytes``) is computed the same way from static metadata, so the two
agree whenever every fresh storage has a static size. The replay runs without the arena: it
measures what the values hold; the report gives the arena's size, held from call to call, apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .interp import PythonLoop
from .program import Program


def _storages(x: Any, out: dict[int, int]) -> None:
    if isinstance(x, torch.Tensor):
        if x.layout == torch.strided and not x.is_meta:
            st = x.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    elif isinstance(x, (list, tuple)):
        for y in x:
            _storages(y, out)


def measure_live_bytes(program: Program, inputs: list[Any] | tuple[Any, ...]) -> list[int]:
    """Run ``program`` on ``inputs`` and return the live intermediate bytes after each node."""
    owned: dict[int, int] = {}
    _storages(list(inputs), owned)
    _storages([c for _, c in program.constants], owned)
    live: list[int] = []

    def after_node(_node: int, regs: list[Any], _t0: int, _t1: int) -> None:
        seen: dict[int, int] = {}
        _storages(regs, seen)
        live.append(sum(n for ptr, n in seen.items() if ptr not in owned and ptr != 0))

    PythonLoop(program, arena=False).run_observed(inputs, after_node)
    return live


@dataclass(frozen=True)
class MemoryReport:
    """Live intermediate bytes of one compiled graph, planned and measured, node by node."""

    nodes: tuple[str, ...]  # node names, in execution order
    planned: tuple[int, ...]  # the plan's prediction after each node (sizes bound to the inputs)
    measured: tuple[int, ...]  # what a replay on the inputs held after each node
    peak_node: str
    peak_bytes: int  # the planned peak
    peak_values: tuple[tuple[str, int], ...]  # (value, bytes) of the storages live at the peak
    arena_bytes: int = 0  # the arena's size: held from call to call, it serves these values
    arena_values: int = 0  # how many values live in the arena

    def text(self, width: int = 40) -> str:
        top = max(self.planned + self.measured, default=0) or 1
        lines = [f"{'node':<28} {'planned':>10} {'measured':>10}"]
        for name, p, m in zip(self.nodes, self.planned, self.measured):
            bar = "#" * round(width * p / top)
            lines.append(f"{name[:28]:<28} {p:>10} {m:>10}  {bar}")
        lines.append(f"peak: {self.peak_bytes} bytes after {self.peak_node}, made of:")
        lines += [f"  %{v}: {b} bytes" for v, b in self.peak_values]
        if self.arena_bytes:
            lines.append(
                f"arena: {self.arena_bytes} bytes, held between calls, serving "
                f"{self.arena_values} of these values"
            )
        return "\n".join(lines)

    def plot(self, path: str) -> str:
        """Write a PNG of planned and measured live bytes (needs matplotlib); return the path."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("the memory plot needs matplotlib: pip install fxrt[plot]") from e
        fig, ax = plt.subplots(figsize=(10, 4))
        xs = range(len(self.nodes))
        ax.step(xs, self.planned, where="post", label="planned")
        ax.plot(xs, self.measured, "o", markersize=3, label="measured")
        ax.set_xlabel("node")
        ax.set_ylabel("live intermediate bytes")
        ax.set_title(f"peak {self.peak_bytes} B after {self.peak_node}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def memory_report(cg: Any, inputs: list[Any] | tuple[Any, ...]) -> MemoryReport:
    """Plan vs replay for compiled graph ``cg`` on ``inputs``, and what makes up the peak."""
    from .plan import bind_sizes

    plan, graph = cg.plan, cg.graph
    planned = plan.live_bytes_for(bind_sizes(graph, inputs))
    measured = measure_live_bytes(cg.program, inputs)
    peak_at = max(range(len(planned)), key=planned.__getitem__) if planned else 0
    # Sizes of the fresh storages live right after the peak node: born at or before it, and
    # freed after it (or never).
    free_at = {v: i for i, vs in enumerate(plan.frees) for v in vs}
    live = []
    for node in graph.nodes[: peak_at + 1]:
        for v in node.outputs:
            if v in plan.roots and free_at.get(v, len(graph.nodes)) >= peak_at:
                meta = graph.values[v].meta
                nbytes = meta.storage_nbytes if meta is not None else 0
                if isinstance(nbytes, str):
                    nbytes = _eval(nbytes, graph, inputs)
                live.append((graph.values[v].name, int(nbytes or 0)))
    return MemoryReport(
        nodes=tuple(n.name for n in graph.nodes),
        planned=tuple(planned),
        measured=tuple(measured),
        peak_node=graph.nodes[peak_at].name if graph.nodes else "",
        peak_bytes=max(planned, default=0),
        peak_values=tuple(sorted(live, key=lambda x: -x[1])),
        arena_bytes=cg.program.arena.nbytes if cg.program.arena is not None else 0,
        arena_values=len(cg.program.arena.slots) if cg.program.arena is not None else 0,
    )


def _eval(expr: str, graph: Any, inputs: Any) -> int:
    import sympy

    from .plan import bind_sizes

    b = bind_sizes(graph, inputs)
    e = sympy.sympify(expr)
    return int(e.subs({s: b[s.name] for s in e.free_symbols if s.name in b}))
