"""Buffer lifetime planning.

1. Alias sets: union-find over values. A node output joins the set of every input it may alias
   (views, in-place results; see :mod:`fxrt.ops.aliasing`), so a base and all of its views form one
   set that shares one storage lifetime.
2. Last use: for every value, the index of the last node that reads it (its defining node if none
   does). A set's last use is the latest over its members.
3. FREEs: right after a set's last use, every register of the set is released. Sets that hold a
   graph input, a constant or a graph output are pinned: the caller owns that memory, so fxrt
   never frees any of their registers.
4. Predicted live bytes: each node output that aliases none of the node's inputs is a fresh
   storage (a "root") and is counted, with its storage size, from the node that makes it until its
   set is freed. Inputs and constants are not counted; outputs are, and never leave.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ir.graph import Graph, refs_in
from ..ops.aliasing import output_aliases


@dataclass(frozen=True)
class Plan:
    """Where each value is released and how many bytes are live along the way."""

    last_use: tuple[int, ...]  # per value id: node index of its last read (-1: inputs never read)
    alias_root: tuple[int, ...]  # per value id: the representative of its alias set
    pinned: frozenset[int]  # value ids never freed (aliases of inputs, constants, outputs)
    frees: tuple[tuple[int, ...], ...]  # per node index: value ids released right after it
    roots: frozenset[int]  # value ids that are fresh storages
    live_bytes: tuple[int, ...]  # per node index: bytes live right after it ran, before its FREEs
    peak_bytes: int  # max of live_bytes (0 for an empty graph)
    exact: bool  # False when some fresh storage has no static size (symbolic shapes, no meta)


class _UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def plan_lifetimes(graph: Graph) -> Plan:
    """Compute the lifetime plan of ``graph`` (see the module docstring)."""
    n = len(graph.values)
    uf = _UnionFind(n)
    last = [-1] * n
    roots: set[int] = set()
    by_storage: dict[int, int] = {}  # constants that share a storage (a folded view) share a set
    for vid, obj in graph.constants.items():
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.numel():
            uf.union(vid, by_storage.setdefault(obj.untyped_storage().data_ptr(), vid))
    for i, node in enumerate(graph.nodes):
        for vid in node.input_ids():
            last[vid] = i
        for vid, aliases in zip(node.outputs, output_aliases(graph, node)):
            last[vid] = max(last[vid], i)
            for a in aliases:
                uf.union(vid, a)
            if not aliases:
                roots.add(vid)

    members: dict[int, list[int]] = {}
    for vid in range(n):
        members.setdefault(uf.find(vid), []).append(vid)
    pinned_roots = {uf.find(v) for v in (*graph.inputs, *graph.constants, *refs_in(graph.output))}
    pinned = frozenset(v for r in pinned_roots for v in members[r])

    frees: list[list[int]] = [[] for _ in graph.nodes]
    free_at: dict[int, int] = {}  # alias root -> node index after which the set is released
    for root, vids in members.items():
        if root in pinned_roots:
            continue
        end = max(last[v] for v in vids)
        if end < 0:  # defined by no node (cannot happen for unpinned sets, kept for safety)
            continue
        frees[end].extend(sorted(vids))
        free_at[root] = end

    exact = True
    born: list[int] = [0] * len(graph.nodes)
    died: list[int] = [0] * len(graph.nodes)
    for i, node in enumerate(graph.nodes):
        for vid in node.outputs:
            if vid not in roots:
                continue
            meta = graph.values[vid].meta
            size = meta.storage_nbytes if meta is not None else 0
            if size is None:
                exact, size = False, 0
            born[i] += size
            end = free_at.get(uf.find(vid))
            if end is not None:
                died[end] += size
    live, now = [], 0
    for i in range(len(graph.nodes)):
        now += born[i]
        live.append(now)
        now -= died[i]

    return Plan(
        last_use=tuple(last),
        alias_root=tuple(uf.find(v) for v in range(n)),
        pinned=pinned,
        frees=tuple(tuple(f) for f in frees),
        roots=frozenset(roots),
        live_bytes=tuple(live),
        peak_bytes=max(live, default=0),
        exact=exact,
    )
