"""Common-subexpression elimination over pure ATen ops.

Two nodes with the same op and the same arguments compute the same values, so the second is
dropped and its readers read the first. Only pure ops qualify (no writes, no randomness), and
only when no node ever writes the storage of their inputs or outputs: after a write, two equal
expressions no longer hold equal values (and merging two fresh results would make a later
in-place op on one visible through the other). A node whose result the caller receives is never
dropped: two outputs of the graph must not become one tensor.

Constants count by content: two small tensor constants with the same dtype, geometry and bytes
(the ``scalar_tensor`` literals each layer's mask building makes) are one value, so the nodes
that read them merge too; never a constant that is written or returned.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..analysis.values import (
    alias_roots,
    is_pure,
    mutated_alias_roots,
    output_alias_roots,
    replace_uses,
)
from ..ir.graph import Graph, substitute_refs


def _key(x: Any) -> Any:
    """A hashable form of an argument tree (lists become tuples, floats keep their type)."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_key(y) for y in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _key(v)) for k, v in x.items()))
    if isinstance(x, slice):
        return ("slice", _key(x.start), _key(x.stop), _key(x.step))
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))  # unhashable constant: only equal to itself
    return (type(x).__name__, x)


_SMALL = 4096  # bytes: constants compared by content up to this size


def _equal_constants(
    graph: Graph, root: tuple[int, ...], mutated: set[int], returned: set[int]
) -> dict[int, int]:
    """Constant -> an earlier constant of the same content (see the module docstring)."""
    first: dict[Any, int] = {}
    mapping: dict[int, int] = {}
    for vid, c in graph.constants.items():
        if not isinstance(c, torch.Tensor) or type(c) is not torch.Tensor or c.is_quantized:
            continue
        if c.layout != torch.strided or c.device.type != "cpu" or c.requires_grad:
            continue
        if c.untyped_storage().nbytes() > _SMALL or root[vid] in mutated or root[vid] in returned:
            continue
        if c.is_conj() or c.is_neg() or c.storage_offset() != 0:
            continue
        # The bytes are read with no dispatch mode active: AOTAutograd compiles under fake mode.
        with _disable_current_modes():
            key = (c.dtype, tuple(c.shape), c.stride(), bytes(c.untyped_storage()))
        if key in first:
            mapping[vid] = first[key]
        else:
            first[key] = vid
    return mapping


def eliminate_common_subexpressions(graph: Graph) -> Graph:
    root = alias_roots(graph)  # once per pass: it walks the whole graph
    mutated = mutated_alias_roots(graph, root)
    returned = output_alias_roots(graph, root)
    seen: dict[Any, list[int]] = {}
    mapping: dict[int, int] = _equal_constants(graph, root, mutated, returned)
    kept = []
    for node in graph.nodes:
        ins = node.input_ids()
        if mapping and any(v in mapping for v in ins):  # reads a dropped node's output
            node.args = substitute_refs(node.args, mapping)
            node.kwargs = substitute_refs(node.kwargs, mapping)
            ins = node.input_ids()
        touched = [*ins, *node.outputs]
        if not is_pure(node) or any(root[v] in mutated for v in touched):
            kept.append(node)
            continue
        key = (node.op.name, _key(node.args), _key(node.kwargs))
        if key in seen and not any(root[v] in returned for v in node.outputs):
            mapping.update(zip(node.outputs, seen[key]))
            continue
        seen.setdefault(key, node.outputs)
        kept.append(node)
    graph.nodes = kept
    replace_uses(graph, mapping)
    return graph
