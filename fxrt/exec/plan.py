"""Buffer lifetime planning.

1. Alias sets, from :func:`fxrt.ops.aliasing.alias_sets` (an analysis of the IR the passes use
   too): a node output joins the set of every input it may alias (views, in-place results), so a
   base and all of its views form one set that shares one storage lifetime.
2. Last use: for every value, the index of the last node that reads it (its defining node if none
   does). A set's last use is the latest over its members.
3. FREEs: right after a set's last use, every register of the set is released. Sets that hold a
   graph input, a constant or a graph output are pinned: the caller owns that memory, so fxrt
   never frees any of their registers.
4. Predicted live bytes: each node output that aliases none of the node's inputs is a fresh
   storage (a "root") and is counted, with its storage size, from the node that makes it until its
   set is freed. Inputs and constants are not counted; outputs are, and never leave. With symbolic
   sizes the counts are sympy expressions in the size symbols, evaluated per call with
   :meth:`Plan.live_bytes_for` and :func:`bind_sizes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..analysis.streams import has_stream_ops
from ..ir.graph import Graph, ValueKind, refs_in
from ..ops.aliasing import alias_sets, is_collective
from .streams import free_points


@dataclass(frozen=True)
class Plan:
    """Where each value is released and how many bytes are live along the way."""

    last_use: tuple[int, ...]  # per value id: node index of its last read (-1: inputs never read)
    alias_root: tuple[int, ...]  # per value id: the representative of its alias set
    pinned: frozenset[int]  # value ids never freed (aliases of inputs, constants, outputs)
    frees: tuple[tuple[int, ...], ...]  # per node index: value ids released right after it
    roots: frozenset[int]  # value ids that are fresh storages
    # Per node index: bytes live right after it ran, before its FREEs. An int, or with symbolic
    # sizes a sympy expression in the size symbols (evaluate it with ``live_bytes_for``).
    live_bytes: tuple[int | str, ...]
    peak_bytes: int  # max of the static entries of live_bytes (0 for an empty graph)
    exact: bool  # False when some fresh storage has an unknown size (no metadata, collectives)
    symbolic: bool = False  # some entry of live_bytes is an expression

    def live_bytes_for(self, bindings: dict[str, int]) -> list[int]:
        """``live_bytes`` with every size symbol bound (``{"s0": 16, ...}``)."""
        out = []
        for x in self.live_bytes:
            if isinstance(x, int):
                out.append(x)
                continue
            expr = _sympify(x)
            expr = expr.subs({s: bindings[s.name] for s in expr.free_symbols if s.name in bindings})
            if expr.free_symbols:
                raise ValueError(f"unbound size symbols {sorted(map(str, expr.free_symbols))}")
            out.append(int(expr))
        return out

    def text(self, names: dict[int, str] | None = None) -> str:
        """Per node index, the bytes live after it and the values released after it."""
        name = (lambda v: f"%{names[v]}") if names else (lambda v: f"%{v}")
        bound = "" if self.exact else " (a lower bound: some sizes are unknown)"
        lines = [f"plan: peak {self.peak_bytes} bytes{bound}, {len(self.pinned)} values pinned"]
        for i, (live, freed) in enumerate(zip(self.live_bytes, self.frees)):
            free = ("  FREE " + ", ".join(map(name, freed))) if freed else ""
            lines.append(f"  {i:>4}  live {live}{free}")
        return "\n".join(lines)


def _sympify(expr: str) -> Any:
    import sympy  # here, not at the top: only symbolic sizes need it, and it costs ~30 MiB, 0.4 s

    return sympy.sympify(expr)


def plan_lifetimes(graph: Graph) -> Plan:
    """Compute the lifetime plan of ``graph`` (see the module docstring)."""
    n = len(graph.values)
    sets = alias_sets(graph)
    root_of, roots = sets.root, sets.fresh
    last = [-1] * n
    for i, node in enumerate(graph.nodes):
        for vid in node.input_ids():
            last[vid] = i
        for vid in node.outputs:
            if last[vid] < i:
                last[vid] = i

    members: dict[int, list[int]] = {}
    for vid in range(n):
        members.setdefault(root_of[vid], []).append(vid)
    pinned_roots = {root_of[v] for v in (*graph.inputs, *graph.constants, *refs_in(graph.output))}
    pinned = frozenset(v for r in pinned_roots for v in members[r])

    frees: list[list[int]] = [[] for _ in graph.nodes]
    free_at: dict[int, int] = {}  # alias root -> node index after which the set is released
    for root, vids in members.items():
        if root in pinned_roots:
            continue
        end = max(last[v] for v in vids)
        if end < 0:  # defined by no node (cannot happen for unpinned sets, kept for safety)
            continue
        free_at[root] = end
    if has_stream_ops(graph):  # freed once every stream that uses it is done (exec.streams)
        free_at = free_points(graph, members, free_at)
    for root, end in free_at.items():
        frees[end].extend(sorted(members[root]))

    # A collective's result shares its input's alias set (fxrt.ops.aliasing) though it is a new
    # storage: the byte count is then a lower bound.
    exact = not any(is_collective(node.op.name) for node in graph.nodes)
    born: list[Any] = [0] * len(graph.nodes)
    died: list[Any] = [0] * len(graph.nodes)
    for i, node in enumerate(graph.nodes):
        for vid in node.outputs:
            if vid not in roots or graph.values[vid].kind is not ValueKind.TENSOR:
                continue
            meta = graph.values[vid].meta
            size: Any = meta.storage_nbytes if meta is not None else None
            if size is None:
                exact, size = False, 0
            elif isinstance(size, str):
                size = _sympify(size)
            born[i] += size
            end = free_at.get(root_of[vid])
            if end is not None:
                died[end] += size
    live: list[Any] = []
    now: Any = 0
    for i in range(len(graph.nodes)):
        now += born[i]
        live.append(now)
        now -= died[i]
    symbolic = any(not isinstance(x, int) for x in live)
    peak = max((x for x in live if isinstance(x, int)), default=0)

    return Plan(
        last_use=tuple(last),
        alias_root=root_of,
        pinned=pinned,
        frees=tuple(tuple(f) for f in frees),
        roots=frozenset(roots),
        live_bytes=tuple(int(x) if isinstance(x, int) else str(x.expand()) for x in live),
        peak_bytes=peak,
        exact=exact,
        symbolic=symbolic,
    )


def bind_sizes(graph: Graph, inputs: list[Any] | tuple[Any, ...]) -> dict[str, int]:
    """Values of the size symbols, read off the actual inputs: a tensor dimension printed as a
    bare symbol (``s0``) and a SymInt input whose expression is a bare symbol bind it."""
    bindings: dict[str, int] = {}
    for vid, x in zip(graph.inputs, inputs):
        v = graph.values[vid]
        if v.meta is not None and isinstance(x, torch.Tensor):
            for dim, actual in zip(v.meta.shape, x.shape):
                if isinstance(dim, str) and dim.isidentifier():
                    bindings[dim] = int(actual)
        elif v.kind is ValueKind.SYM and v.expr and v.expr.isidentifier():
            bindings[v.expr] = int(x)
    return bindings
