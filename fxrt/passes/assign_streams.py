"""``streams="auto"``: put independent branches on streams of their own.

1. **Branches.** Pure ATen nodes are joined into chains along single-use edges (a node whose
   only reader is the next one belongs with it), with union-find. A node whose single-use inputs
   come from two or more chains is a join (the ``add`` of two experts' outputs) and starts a
   chain of its own, as does every node whose value several nodes read (a fork). Impure and
   Python nodes stay on the caller's stream and belong to no chain.
2. **Cost.** A chain's estimated time: a fixed cost per op (the loop's dispatch, all a view
   costs) plus, for a matrix product, the larger of its arithmetic (``2*m*n*k``) and the bytes
   of its operands (small batches only read the weights), and one unit per element for the
   rest, at nominal single-thread rates. A chain worth a stream of its own must be estimated at
   :data:`MIN_BRANCH_US` at least: a hand-off to a worker thread and the wait for it cost a few
   microseconds.
3. **Groups.** Chains worth it, in program order, form groups of pairwise independent chains
   (neither reaches the other in the dependence graph: data, plus the order of every write to
   an alias set with the nodes touching it, plus the order of side effects). In each group of
   two or more, chains are spread over ``max_streams`` streams, longest first onto the least
   loaded (a side stream first: the caller's stream also hands the others their work).
4. **Order.** The nodes are reordered (a topological order of the same dependences) so that a
   group's side-stream chains come before its caller's-stream ones, and caller's-stream nodes
   that read a side stream's result after those that do not; runs of one side stream are
   wrapped in ``scope_enter``/``scope_exit`` (labels ``auto1``, ``auto2``...), and
   :func:`~fxrt.passes.synchronize_streams.synchronize_streams` inserts the records and waits.

A graph that already has stream ops, or in which no group is found, is returned unchanged.
"""

from __future__ import annotations

import heapq
import math

from ..analysis.values import alias_roots, is_pure, written_values
from ..ir.graph import Graph, Node, OpKind
from .synchronize_streams import _Builder, has_stream_ops, synchronize_streams

MIN_BRANCH_US = 40.0  # a chain below this runs on the caller's stream
OP_US = 1.0  # dispatch cost of one op in the compiled loop
FLOPS_PER_US = 2.0e4  # nominal single-thread rate for matrix products
BYTES_PER_US = 1.0e4  # nominal rate of reading a matrix product's operands
ELEMENTS_PER_US = 2.0e3  # nominal rate for other ops
_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}


def node_cost_us(graph: Graph, node: Node) -> float:
    """Estimated microseconds of one node on the CPU (see the module docstring)."""
    if node.op.kind is not OpKind.ATEN or _is_view(node):
        return OP_US
    out = graph.values[node.outputs[0]].meta if node.outputs else None
    numel = math.prod(s for s in out.shape if isinstance(s, int)) if out is not None else 0
    if node.op.name in _MATMULS:
        metas = [graph.values[v].meta for v in node.input_ids()]
        ks = [m.shape[-1] for m in metas if m is not None and m.shape and len(m.shape) >= 2]
        k = max((x for x in ks if isinstance(x, int)), default=1)
        nbytes = sum(m.storage_nbytes for m in metas if m and isinstance(m.storage_nbytes, int))
        # Small batches are bound by reading the weights, large ones by the arithmetic.
        return OP_US + max(2.0 * numel * k / FLOPS_PER_US, nbytes / BYTES_PER_US)
    return OP_US + numel / ELEMENTS_PER_US


def _is_view(node: Node) -> bool:
    returns = node.op.target._schema.returns
    return bool(returns) and returns[0].alias_info is not None


def _dependences(graph: Graph) -> list[set[int]]:
    """Per node, the nodes it must follow: data, writes of alias sets, side effects."""
    nodes = graph.nodes
    root = alias_roots(graph)
    made = {v: i for i, n in enumerate(nodes) for v in n.outputs}
    deps: list[set[int]] = [set() for _ in nodes]
    touched: dict[int, list[int]] = {}  # alias root -> nodes touching it since its last write
    last_write: dict[int, int] = {}
    last_effect = -1
    for i, node in enumerate(nodes):
        ins = node.input_ids()
        deps[i].update(made[v] for v in ins if v in made)
        writes = written_values(node)
        for v in {root[x] for x in ins} | {root[x] for x in node.outputs}:
            if v in last_write:
                deps[i].add(last_write[v])
        for v in {root[x] for x in writes}:
            deps[i].update(touched.get(v, ()))
            last_write[v] = i
            touched[v] = []
        for v in {root[x] for x in (*ins, *node.outputs)}:
            touched.setdefault(v, []).append(i)
        if not is_pure(node):
            if last_effect >= 0:
                deps[i].add(last_effect)
            last_effect = i
        deps[i].discard(i)
    return deps


def _find(parent: list[int], x: int) -> int:
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def assign_streams(graph: Graph, max_streams: int = 2) -> Graph:
    """Put independent branches of ``graph`` on up to ``max_streams`` streams (see the module
    docstring); returns ``graph``, edited in place, or unchanged."""
    if max_streams < 2 or has_stream_ops(graph) or len(graph.nodes) < 4:
        return graph
    nodes = graph.nodes
    n = len(nodes)
    made = {v: i for i, node in enumerate(nodes) for v in node.outputs}
    readers: dict[int, set[int]] = {}
    for i, node in enumerate(nodes):
        for v in node.input_ids():
            readers.setdefault(v, set()).add(i)
    output_ids = set(graph.output_ids())
    candidate = [node.op.kind is OpKind.ATEN and is_pure(node) for node in nodes]

    # 1. chains along single-use edges; a cheap node on the graph's inputs alone (a weight's
    # transpose) joins its reader's chain and never makes that reader a join
    parent = list(range(n))
    leaf = [
        candidate[i]
        and all(v not in made for v in node.input_ids())
        and node_cost_us(graph, node) <= 2 * OP_US
        for i, node in enumerate(nodes)
    ]
    for i, node in enumerate(nodes):
        if not candidate[i]:
            continue
        chains, leaves = set(), set()
        for v in node.input_ids():
            j = made.get(v)
            if j is None or not candidate[j] or v in output_ids:
                continue
            if len(readers.get(v, ())) == 1 and all(
                len(readers.get(o, ())) <= 1 for o in nodes[j].outputs
            ):
                (leaves if leaf[j] else chains).add(_find(parent, j))
        if len(chains) == 1:
            parent[_find(parent, i)] = chains.pop()
        for r in leaves:
            parent[_find(parent, r)] = _find(parent, i)
    members: dict[int, list[int]] = {}
    for i in range(n):
        if candidate[i]:
            members.setdefault(_find(parent, i), []).append(i)

    # 2. cost
    cost = {r: sum(node_cost_us(graph, nodes[i]) for i in ms) for r, ms in members.items()}
    big = sorted((r for r in members if cost[r] >= MIN_BRANCH_US), key=lambda r: members[r][0])
    if len(big) < 2:
        return graph

    # 3. groups of pairwise independent chains
    deps = _dependences(graph)
    ancestors = [0] * n
    for i in range(n):
        mask = 0
        for j in deps[i]:
            mask |= ancestors[j] | (1 << j)
        ancestors[i] = mask
    mask_of = {r: sum(1 << i for i in members[r]) for r in big}
    anc_of = {r: _or(ancestors[i] for i in members[r]) for r in big}

    def independent(a: int, b: int) -> bool:
        return not (anc_of[a] & mask_of[b]) and not (anc_of[b] & mask_of[a])

    groups: list[list[int]] = []
    for r in big:
        if groups and all(independent(r, o) for o in groups[-1]):
            groups[-1].append(r)
        else:
            groups.append([r])
    stream_of = [0] * n
    group_start = {}
    found = False
    for group in groups:
        if len(group) < 2:
            continue
        found = True
        order = [*range(1, max_streams), 0]
        load = dict.fromkeys(order, 0.0)
        for r in sorted(group, key=lambda r: -cost[r]):
            s = min(order, key=lambda s: load[s])
            load[s] += cost[r]
            start = min(i for g in group for i in members[g])
            for i in members[r]:
                stream_of[i] = s
                group_start[i] = start
    if not found:
        return graph

    # 4. order: side-stream chains of a group first, then wrap runs in scopes
    # Caller's-stream nodes that read a side stream's result (a join, the gate's product of an
    # expert) wait for it: they come after every caller's-stream node that does not, so that the
    # caller's own branch runs while the side streams run theirs.
    side_mask = sum(1 << i for i in range(n) if stream_of[i])
    key = [
        (group_start[i], 0, i)
        if stream_of[i]
        else ((n + i, 1, i) if ancestors[i] & side_mask else (i, 1, i))
        for i in range(n)
    ]
    waiting = [len(d) for d in deps]
    followers: list[list[int]] = [[] for _ in range(n)]
    for i, d in enumerate(deps):
        for j in d:
            followers[j].append(i)
    ready = [key[i] for i in range(n) if waiting[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        *_, i = heapq.heappop(ready)
        order.append(i)
        for f in followers[i]:
            waiting[f] -= 1
            if waiting[f] == 0:
                heapq.heappush(ready, key[f])
    assert len(order) == n, "the dependences of a graph's nodes are acyclic"
    b = _Builder(graph)
    out: list[Node] = []
    current = 0
    for i in order:
        if stream_of[i] != current:
            if current:
                out.append(b.exit())
            if stream_of[i]:
                out.append(b.enter(f"auto{stream_of[i]}"))
            current = stream_of[i]
        out.append(nodes[i])
    if current:
        out.append(b.exit())
    graph.nodes = out
    return synchronize_streams(graph, log_inserted=False)


def _or(masks) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


__all__ = ["MIN_BRANCH_US", "assign_streams", "node_cost_us"]
