"""Pattern fusion: chains of small ATen ops that compute a known piece of math become one call of
the device's fused op (see :mod:`fxrt.patterns` for the patterns, their targets and how to add
one).

For each registered pattern not turned off, in registration order, the pass scans the graph once:

1. each node whose op is one of the pattern's anchors goes to its matcher, which returns a
   :class:`~fxrt.patterns.Match` or None; a match that shares a node with an earlier one is
   dropped;
2. the target is the pattern's entry for the device of the match's first result: none, a
   library that is not there, an fxrt op while own ops are off, or a guard that says no, and the
   ATen ops stay;
3. the rewrite must be sound where it lands: the fused call goes where the match's last node
   was (or after the node the match names, ``Match.at``), so every argument must be made before
   that point and every reader of a result after it, and nothing in between may write an
   argument's storage;
4. the fused node (named ``fused_<pattern>``) takes the replaced values' metadata (the target's
   guard vouched for the layout), after the views and the values its arguments name
   (:class:`View`, :class:`Made`: one node each, made once per match); readers of a replaced
   value read the fused result; the matched nodes that nothing else reads are removed.

:func:`fxrt.pattern_counts` counts, in any graph (a fresh compile's, a cache entry's, a loaded
package's), the fused nodes of each pattern by their names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from ..analysis.values import alias_roots, replace_uses, unique_name, written_values
from ..ir.from_fx import tensor_meta
from ..ir.graph import Graph, Node, Op, Ref, TensorMeta, ValueKind, map_refs, refs_in
from ..patterns import (
    PREFIX,
    GraphIndex,
    Made,
    Match,
    Pattern,
    Target,
    View,
    registered_patterns,
    target_device,
)


def fuse_patterns(graph: Graph, disabled: Iterable[str] = (), own_ops: bool = True) -> Graph:
    """Apply every registered pattern not in ``disabled`` to ``graph`` (in place); return it.
    ``own_ops`` false: no target that is an ``fxrt::`` op."""
    off = set(disabled)
    for pattern in registered_patterns().values():
        if pattern.name in off:
            continue
        if not any(n.op.name in pattern.anchors for n in graph.nodes):
            continue
        _apply(graph, pattern, own_ops)
    return graph


def _apply(graph: Graph, pattern: Pattern, own_ops: bool) -> None:
    index = GraphIndex(graph)
    root: tuple[int, ...] | None = None
    chosen: list[tuple[Match, list[Match], Op, list[int]]] = []
    placed: dict[int, int] = {}  # value a chosen match replaces -> its fused call's place
    for node in list(graph.nodes):
        if node.op.name not in pattern.anchors or id(node) in index.claimed:
            continue
        try:
            match = pattern.match(node, index)
        except Exception as e:
            raise RuntimeError(
                f"pattern {pattern.name!r} failed matching node {node.name!r} ({node.op.name}): "
                f"{type(e).__name__}: {e}"
            ) from e
        if match is None or any(id(n) in index.claimed for n in match.nodes):
            continue
        _check_views(pattern, node, match)
        found = _target(pattern, match, index, own_ops)
        if found is None:
            continue
        calls, op = found
        root = root if root is not None else alias_roots(graph)
        at = [_place(graph, index, c, root, placed) for c in calls]
        if None in at:
            continue
        index.claimed.update(id(n) for n in match.nodes)
        for c, pos in zip(calls, at):
            placed.update((r, pos) for r in c.results if r is not None)
        chosen.append((match, calls, op, at))
    if chosen:
        _rewrite(graph, index, pattern, chosen)


def _check_views(pattern: Pattern, node: Node, match: Match) -> None:
    """A :class:`View` argument names an op whose result is a view of its first argument (no
    data is computed between the chain and the fused call)."""
    for a in _made_args(match):
        if not isinstance(a, View):
            continue
        schema = getattr(a.op, "_schema", None)
        alias = schema.returns[0].alias_info if schema is not None and schema.returns else None
        if alias is None or alias.is_write or not isinstance(a.args[0], Ref):
            raise ValueError(
                f"pattern {pattern.name!r} at node {node.name!r}: View({a.op}) is not a view op "
                "(its result must alias its first argument, a graph value); pass the value "
                "itself, or a view such as torch.ops.aten.transpose.int"
            )


def _target(
    pattern: Pattern, match: Match, index: GraphIndex, own_ops: bool
) -> tuple[list[Match], Op] | None:
    first = next((r for r in match.results if r is not None), None)
    meta = None if first is None else index.graph.values[first].meta
    if meta is None:
        return None
    target: Target | None = pattern.targets.get(target_device(meta.device.split(":")[0]))
    if target is None:
        return None
    op = target.resolve()
    if op is None or (not own_ops and op.name().startswith("fxrt::")):
        return None
    if target.guard is not None and not target.guard(match, index):
        return None
    calls = [match]
    if target.adapt is not None:
        adapted = target.adapt(match, index)
        if not adapted:
            return None
        calls = adapted if isinstance(adapted, list) else [adapted]
    return calls, Op.of(op)


def _place(
    graph: Graph, index: GraphIndex, m: Match, root: tuple[int, ...], placed: dict[int, int]
) -> int | None:
    """Where the fused call of ``m`` goes (the index of the node it follows), or None when no
    place is sound: after every argument is made (``placed``: values earlier matches replace, at
    their calls' places), before every outside reader of a result, and with nothing between the
    chain and that place writing an argument."""
    positions = [index.position[id(n)] for n in m.nodes]
    first, last = min(positions), max(positions)
    at = index.position[id(m.at)] if m.at is not None else last
    inside = {id(n) for n in m.nodes}
    args = refs_in(_graph_args((m.args, m.kwargs)))
    for v in args:
        p = index.producer.get(v)
        if p is None:
            continue
        if id(p) in inside or placed.get(v, index.position[id(p)]) >= at:
            return None  # an argument made by the chain itself, or after the call's place
    for r in m.results:
        if r is None:
            continue
        for reader in index.readers.get(r, ()):
            if id(reader) not in inside and index.position[id(reader)] <= at:
                return None
    read = {root[v] for v in args}
    lo, hi = min(first, at), max(last, at)
    if any(root[w] in read for n in graph.nodes[lo:hi] for w in written_values(n)):
        return None
    return at


def _rewrite(
    graph: Graph,
    index: GraphIndex,
    pattern: Pattern,
    chosen: list[tuple[Match, list[Match], Op, list[int]]],
) -> None:
    taken = {n.name for n in graph.nodes} | {v.name for v in graph.values}
    after: dict[int, list[Node]] = {}  # node index -> the fused calls placed after it
    removed: set[int] = set()
    mapping: dict[int, int] = {}
    consumed: set[int] = set()  # constants a value made of constants read
    for match, calls, op, places in chosen:
        returns = op.target._schema.returns
        multi = len(returns) > 1
        made: dict[int, Ref] = {}  # id() of a View / Made -> its value, made once per match
        for m, at in sorted(zip(calls, places), key=lambda c: c[1]):
            name = unique_name(taken, PREFIX + pattern.name)
            outputs = []
            for i, r in enumerate(m.results):
                value_name = unique_name(taken, f"{name}_{i}") if multi else name
                if r is None and not isinstance(returns[i].type, torch.TensorType):
                    vid = graph.add_value(value_name, ValueKind.SCALAR)  # an unread number
                    outputs.append(vid)
                    continue
                meta = graph.values[r].meta if r is not None else _spare_meta(graph, m, i)
                vid = graph.add_value(value_name, ValueKind.TENSOR, meta)
                outputs.append(vid)
                if r is not None:
                    mapping[r] = vid
            trace = graph.nodes[at].stack_trace if m.at is not None else None
            trace = trace or max(m.nodes, key=lambda n: index.position[id(n)]).stack_trace
            make = _Maker(graph, taken, pattern.name, trace, after.setdefault(at, []), made,
                          consumed)  # fmt: skip
            args = tuple(make(a) for a in m.args)
            kwargs = {k: make(a) for k, a in m.kwargs.items()}
            fused = Node(name, op, args, kwargs, outputs, multi, trace)
            after.setdefault(at, []).append(fused)
        # A matched node goes when each of its results is replaced or read only by nodes that
        # go (decided from the last node back, so its readers are decided first); one whose
        # result something else still reads stays, and so do the nodes it reads.
        replaced = set(mapping)
        for n in sorted(match.nodes, key=lambda n: -index.position[id(n)]):
            if all(
                v in replaced
                or (
                    v not in index.returned
                    and all(id(x) in removed for x in index.readers.get(v, ()))
                )
                for v in n.outputs
            ):
                removed.add(id(n))
    nodes = []
    for i, n in enumerate(graph.nodes):
        if id(n) not in removed:
            nodes.append(n)
        nodes.extend(after.get(i, ()))
    dropped = {v for n in graph.nodes if id(n) in removed for v in n.input_ids()}
    graph.nodes = nodes
    # Readers of a replaced value, fused calls of a later match included, read the fused result.
    replace_uses(graph, mapping)
    # A constant only the removed nodes, or a value made of it, read (a folded mask) goes.
    read = {v for n in nodes for v in n.input_ids()} | set(graph.output_ids())
    for v in (dropped | consumed) - read:
        graph.constants.pop(v, None)


def _made_args(m: Match) -> Iterable[Any]:
    """Every :class:`View` and :class:`Made` among ``m``'s arguments, nested ones too."""
    todo = [*m.args, *m.kwargs.values()]
    while todo:
        a = todo.pop()
        if isinstance(a, (list, tuple)):
            todo.extend(a)
        elif isinstance(a, (View, Made)):
            yield a
            todo.extend(a.args)
            todo.extend(getattr(a, "kwargs", {}).values())


def _graph_args(tree: Any) -> Any:
    """``tree`` with each :class:`View` / :class:`Made` replaced by its arguments: what the
    fused call reads of the graph."""
    if isinstance(tree, (View, Made)):
        return [_graph_args(a) for a in tree.args] + [_graph_args(getattr(tree, "kwargs", {}))]
    if isinstance(tree, (list, tuple)):
        return [_graph_args(a) for a in tree]
    if isinstance(tree, dict):
        return {k: _graph_args(a) for k, a in tree.items()}
    return tree


class _Maker:
    """Turns a fused call's argument into what the node reads: each :class:`View` and
    :class:`Made` (its arguments first) becomes a node placed before the call, once per match
    (``made``)."""

    def __init__(self, graph: Graph, taken: set, pattern: str, trace: Any, before: list,
                 made: dict[int, Ref], consumed: set[int]) -> None:  # fmt: skip
        self.graph, self.taken, self.pattern, self.trace = graph, taken, pattern, trace
        self.before, self.made, self.consumed = before, made, consumed

    def __call__(self, a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(self(x) for x in a)
        if not isinstance(a, (View, Made)):
            return a
        if id(a) in self.made:
            return self.made[id(a)]
        args = tuple(self(x) for x in a.args)
        kwargs = {k: self(x) for k, x in getattr(a, "kwargs", {}).items()}
        kind = "view" if isinstance(a, View) else "made"
        name = unique_name(self.taken, f"{self.pattern}_{kind}")
        reads = refs_in((args, kwargs))
        if isinstance(a, Made) and reads and all(v in self.graph.constants for v in reads):
            # made of constants (a folded mask): made once, now, a constant itself
            known = self.graph.constants
            with torch.inference_mode(False), torch.no_grad():
                value = a.op(*map_refs(args, lambda r: known[r.id]),
                             **map_refs(kwargs, lambda r: known[r.id]))  # fmt: skip
            vid = self.graph.add_value(name, ValueKind.TENSOR, tensor_meta(value))
            known[vid] = value
            self.consumed.update(reads)
            self.made[id(a)] = Ref(vid)
            return self.made[id(a)]
        meta = a.meta if a.meta is not None else self._meta(a.op, args, kwargs)
        vid = self.graph.add_value(name, ValueKind.TENSOR, meta)
        self.before.append(Node(name, Op.of(a.op), args, kwargs, [vid], False, self.trace))
        self.made[id(a)] = Ref(vid)
        return self.made[id(a)]

    def _meta(self, op: Any, args: tuple, kwargs: dict) -> TensorMeta:
        """The result's metadata: ``op`` run on meta-device stand-ins of its tensor arguments,
        on the device of the first."""
        metas = [self.graph.values[v].meta for v in refs_in((args, kwargs))]
        if not metas or any(m is None or not m.is_static for m in metas):
            raise ValueError(
                f"fxrt: pattern {self.pattern!r}: Made({op}) needs static tensor arguments to "
                "work out its result's shape; give its meta"
            )

        def fake(x: Any) -> Any:
            if isinstance(x, Ref):
                m = self.graph.values[x.id].meta
                return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
            if isinstance(x, (list, tuple)):
                return type(x)(fake(y) for y in x)
            return x

        out = op(*fake(args), **{k: fake(v) for k, v in kwargs.items()})
        return dataclasses.replace(tensor_meta(out), device=metas[0].device)


def _spare_meta(graph: Graph, m: Match, i: int):
    """Metadata of a result nothing reads: that of the argument it is computed from (the fused
    op's results have their inputs' geometry), or of the first result."""
    arg = m.args[i] if i < len(m.args) and isinstance(m.args[i], Ref) else None
    source = arg.id if arg is not None else m.results[0]
    return graph.values[source].meta


__all__ = ["fuse_patterns"]
