"""Alias analysis: which values may share storage, per node and for a whole graph.

Per node (:func:`output_aliases`): for an ATen op the answer comes from its schema's alias
annotations: an output annotated ``Tensor(a)`` (a view) or ``Tensor(a!)`` (an in-place result)
aliases every argument annotated with the same set ``a``; a ``Tensor(a)[]`` return aliases it
element by element. For a Python fallback (higher-order ops included) nothing is known, so every
output is assumed to alias every tensor-like input.

Per graph (:func:`alias_sets`): a union-find over value ids. A node output joins the set of every
input it may alias, and constants that share a storage (a folded view and its base) share a set,
so a base and all of its views form one set. Each set is named by its smallest value id, whatever
the order of the unions. An output that aliases none of its node's inputs is a *fresh* storage.
The lifetime planner (:mod:`fxrt.exec.plan`) and the passes (:mod:`fxrt.analysis.values`) both
read the sets from here: an analysis of the IR, computed once per pass or plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..ir.graph import Graph, Node, OpKind, ValueKind, refs_in


def bind_schema_args(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Map argument names to the values a call passes for them (defaults not filled)."""
    bound: dict[str, Any] = {}
    positional = [a for a in schema.arguments if not a.kwarg_only]
    for a, v in zip(positional, args):
        bound[a.name] = v
    for k, v in kwargs.items():
        bound[k] = v
    return bound


# Ops whose schema has no alias annotation but whose results share their first argument's
# storage. ``_unsafe_view`` is a view that autograd treats as fresh (its input is always a
# temporary), and so are the pieces of ``unsafe_split``, ``unsafe_split_with_sizes`` and
# ``unsafe_chunk`` (GRUCell's decomposition splits its gates with them); Inductor's
# ``reinterpret_tensor`` is a raw alias with no view tracking at all.
UNANNOTATED_VIEWS = frozenset(
    {
        "aten::_unsafe_view",
        "aten::unsafe_split.Tensor",
        "aten::unsafe_split_with_sizes",
        "aten::unsafe_chunk",
        "inductor::_reinterpret_tensor",
    }
)

# torch.distributed collectives, as Dynamo and DTensor capture them. Their schemas carry no alias
# annotations, yet a collective may read its input and fill its output asynchronously until the
# ``wait_tensor`` on that output, and ``wait_tensor`` returns its argument itself. For liveness,
# a collective's output joins the alias set of its tensor inputs, and a wait's result joins its
# argument's set: no FREE of any of them comes before the wait (or the waited result's last use).
# Passes also treat these ops as side-effecting (see ``fxrt.analysis.values``).
COLLECTIVE_NAMESPACES = ("_c10d_functional::", "_dtensor::")
WAIT_OPS = frozenset({"_c10d_functional::wait_tensor"})


def is_collective(name: str) -> bool:
    """True for a collective or a wait on one (by qualified op name, ``ns::op``)."""
    return name.startswith(COLLECTIVE_NAMESPACES)


def output_aliases(graph: Graph, node: Node) -> list[list[int]]:
    """For each output of ``node``, the ids of the inputs it may alias."""
    if node.op.kind is OpKind.ATEN:
        schema = node.op.schema
        if node.copies:
            return [[] for _ in node.outputs]
        if node.op.name in UNANNOTATED_VIEWS or node.op.name in WAIT_OPS:
            return [refs_in(node.args[0])] * len(node.outputs)
        if is_collective(node.op.name):  # see COLLECTIVE_NAMESPACES
            return [node.input_ids()] * len(node.outputs)
        bound = bind_schema_args(schema, node.args, node.kwargs)
        sets_of: list[tuple[frozenset[str], list[int]]] = []
        for a in schema.arguments:
            if a.alias_info is not None and a.name in bound:
                sets_of.append((frozenset(a.alias_info.before_set), refs_in(bound[a.name])))

        def aliased_by(ret: torch.Argument) -> list[int]:
            if ret.alias_info is None:
                return []
            mine = set(ret.alias_info.before_set)
            if "*" in mine:  # wildcard: may alias anything passed in
                return node.input_ids()
            if not mine:
                # A list return such as split's ``Tensor(a)[]`` keeps its element alias sets in
                # the contained type, which Python cannot see: alias every annotated argument.
                return [v for _, ids in sets_of for v in ids]
            return [v for sets, ids in sets_of if sets & mine for v in ids]

        returns = schema.returns
        if len(returns) == 1:
            return [aliased_by(returns[0])] * len(node.outputs)
        return [aliased_by(r) for r in returns][: len(node.outputs)]
    # A higher-order op (torch.cond, ...) is a Python fallback like any other here: on the
    # inference path nothing functionalizes it, and a branch may return a view of its operand.
    if all(
        graph.values[v].kind in (ValueKind.NONE, ValueKind.SYM, ValueKind.SCALAR)
        for v in node.outputs
    ):
        return [[] for _ in node.outputs]  # a None or a number shares no storage
    tensorish = [
        v for v in node.input_ids() if graph.values[v].kind in (ValueKind.TENSOR, ValueKind.OTHER)
    ]
    return [tensorish] * len(node.outputs)


def is_mutating(node: Node) -> bool:
    """True if the node writes to one of its arguments (schema ``(a!)``) or is opaque Python."""
    if node.op.kind is not OpKind.ATEN:
        return True
    return node.op.schema.is_mutable


@dataclass(frozen=True)
class AliasSets:
    """The alias sets of a graph's values (see the module docstring)."""

    root: tuple[int, ...]  # per value id: its set's representative, the set's smallest id
    fresh: frozenset[int]  # node outputs that alias none of their node's inputs: new storages


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


def alias_sets(graph: Graph) -> AliasSets:
    """The alias sets of ``graph``'s values and its fresh storages, in one walk over the nodes."""
    uf = _UnionFind(len(graph.values))
    fresh: set[int] = set()
    by_storage: dict[int, int] = {}  # constants that share a storage (a folded view) share a set
    for vid, obj in graph.constants.items():
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and obj.numel():
            uf.union(vid, by_storage.setdefault(obj.untyped_storage().data_ptr(), vid))
    for node in graph.nodes:
        for vid, aliases in zip(node.outputs, output_aliases(graph, node)):
            for a in aliases:
                uf.union(vid, a)
            if not aliases:
                fresh.add(vid)
    find = uf.find
    return AliasSets(tuple(find(v) for v in range(len(graph.values))), frozenset(fresh))
