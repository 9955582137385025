"""Facts passes share: which ops are pure or have side effects, which values a node writes, which
alias sets are ever written or returned, and how to redirect uses of a value.

Alias sets come from :func:`fxrt.ops.aliasing.alias_sets`, an analysis of the IR (the lifetime
planner reads the same sets); a pass computes them once, at its start, with :func:`alias_roots`,
and hands them to :func:`mutated_alias_roots` and :func:`output_alias_roots`. Nothing here (or in
any pass) depends on the planner, the arena or the lowering.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Node, OpKind, ValueKind, refs_in, substitute_refs
from ..ops.aliasing import alias_sets, bind_schema_args, is_collective
from ..ops.streams import is_stream_op


def is_pure(node: Node) -> bool:
    """An ATen op that writes nothing, draws no random numbers and has no other side effect."""
    if node.op.kind is not OpKind.ATEN:
        return False
    target = node.op.target
    if target._schema.is_mutable or is_collective(node.op.name):  # a collective is never merged
        return False
    if is_stream_op(node.op.name):  # scopes and events are where they are, never merged
        return False
    tags = set(getattr(target, "tags", ()))
    return not (tags & {torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise})


def has_side_effects(node: Node) -> bool:
    """Must run even if nothing reads its outputs."""
    if node.op.kind is not OpKind.ATEN:
        return True  # opaque Python
    target = node.op.target
    if target._schema.is_mutable or "assert" in node.op.name or "print" in node.op.name:
        return True
    if is_collective(node.op.name):  # every rank must issue (and wait on) the same collectives
        return True
    if is_stream_op(node.op.name):
        return True
    return torch.Tag.nondeterministic_seeded in set(getattr(target, "tags", ()))


def written_values(node: Node) -> list[int]:
    """Ids of the inputs ``node`` may write: ``(a!)`` arguments, or everything for Python."""
    if node.op.kind is not OpKind.ATEN:
        return node.input_ids()
    schema = node.op.target._schema
    if not schema.is_mutable:  # no (a!) argument at all: most ops, and no need to bind them
        return []
    bound = bind_schema_args(schema, node.args, node.kwargs)
    return [
        v
        for a in schema.arguments
        if a.alias_info is not None and a.alias_info.is_write and a.name in bound
        for v in refs_in(bound[a.name])
    ]


def mutated_alias_roots(graph: Graph, root: tuple[int, ...] | None = None) -> set[int]:
    """Alias-set representatives (``Plan.alias_root``) of every storage some node writes.

    Graph inputs may alias one another at run time (two views of one tensor passed as two
    inputs), so a write to any input counts as a write to every tensor input. ``root`` is
    ``alias_roots(graph)`` when the caller has it already (computing it walks the whole graph)."""
    if root is None:
        root = alias_roots(graph)
    written = {root[v] for node in graph.nodes for v in written_values(node)}
    inputs = {root[v] for v in graph.inputs if graph.values[v].kind is ValueKind.TENSOR}
    if written & inputs:
        written |= inputs
    return written


def alias_roots(graph: Graph) -> tuple[int, ...]:
    """Per value id, the representative of its alias set (``Plan.alias_root`` is the same). A
    pass computes it once, at its start: it walks the whole graph."""
    return alias_sets(graph).root


def output_alias_roots(graph: Graph, root: tuple[int, ...]) -> set[int]:
    """Alias sets the caller receives: a pass must not make them share storage with anything
    new, or a caller's write to an output would reach another value."""
    return {root[v] for v in refs_in(graph.output)}


def unique_name(taken: set[str], base: str) -> str:
    """``base``, or ``base_1``, ``base_2``... the first not in ``taken``; added to it."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def replace_uses(graph: Graph, mapping: dict[int, int]) -> None:
    """Rewrite every read of ``old`` into a read of ``mapping[old]`` (nodes and output). Nodes
    that read none of them keep their very argument objects (see ``substitute_refs``)."""
    if not mapping:
        return
    for node in graph.nodes:
        node.args = substitute_refs(node.args, mapping)
        node.kwargs = substitute_refs(node.kwargs, mapping)
    graph.output = substitute_refs(graph.output, mapping)
