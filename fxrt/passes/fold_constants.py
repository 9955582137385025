"""Constant folding: run, at compile time, pure ops whose inputs are all constants.

Only constants the caller cannot reach are folded through: tensor literals of Dynamo's graph (its
parameters and buffers are graph inputs), pure ops of no input at all (a causal mask made in
``forward`` as ``torch.ones(s, s, dtype=torch.bool).tril()``: the same tensor every call), and the
results of earlier folds. Random factories are not pure and stay. A graph handed to
``compile_graph`` holds the caller's weights as constants; those stay live (an in-place update
after compiling changes the next result, and autograd reaches them) and are folded only when the
user asks for ``freeze``, which promises that they never change. ``foldable`` says which constants
may be folded (None: all). Folding runs with autograd off and outside inference mode (and, as every
built-in pass, outside any fake mode: fxrt.pipeline), so a folded constant is a plain, real tensor
in every later grad mode.

The results become constants the graph owns. Constants some node writes (a buffer updated in
place) are never folded through, since their value changes from call to call. A result larger
than ``max_bytes`` is not folded, so folding never blows up memory (an ``expand`` of a constant
materialised by a later op, say). Results the caller receives (or views of them) are not folded:
each call must return a new tensor, as eager does, not one shared constant.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from ..analysis.values import alias_roots, is_pure, mutated_alias_roots, output_alias_roots
from ..ir.from_fx import tensor_meta
from ..ir.graph import Graph, ValueKind, map_refs

DEFAULT_MAX_BYTES = 16 * 1024 * 1024


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.untyped_storage().nbytes() if x.layout == torch.strided else 0
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def fold_constants(
    graph: Graph, max_bytes: int = DEFAULT_MAX_BYTES, foldable: Collection[int] | None = None
) -> Graph:
    if not any(foldable is None or v in foldable for v in graph.constants) and not any(
        not n.input_ids() and is_pure(n) for n in graph.nodes
    ):
        # Nothing to fold through (the usual case: compile_graph folds only frozen weights) and
        # nothing made from no input, so no node can fold: skip the alias analysis, which walks
        # the whole graph.
        return graph
    root = alias_roots(graph)  # once per pass
    mutated = mutated_alias_roots(graph, root)
    returned = output_alias_roots(graph, root)
    known = {
        v: c
        for v, c in graph.constants.items()
        if root[v] not in mutated and (foldable is None or v in foldable)
    }
    kept, made = [], []
    for node in graph.nodes:
        ins = node.input_ids()
        if (
            not is_pure(node)
            or not all(v in known for v in ins)
            or any(root[v] in mutated or root[v] in returned for v in node.outputs)
        ):
            kept.append(node)
            continue
        args = map_refs(node.args, lambda r: known[r.id])
        kwargs = map_refs(node.kwargs, lambda r: known[r.id])
        try:
            with torch.inference_mode(False), torch.no_grad():
                result = node.op.target(*args, **kwargs)
        except Exception:  # leave it to fail (or not) at run time, with the usual error
            kept.append(node)
            continue
        values = list(result) if node.multi else [result]
        if _nbytes(values) > max_bytes:
            kept.append(node)
            continue
        made += node.outputs
        for vid, val in zip(node.outputs, values):
            known[vid] = val
            graph.constants[vid] = val
            old = graph.values[vid]
            if isinstance(val, torch.Tensor):
                graph.values[vid] = type(old)(vid, old.name, ValueKind.TENSOR, tensor_meta(val))
    graph.nodes = kept
    # A fold's result that only later folds read (the ones under a folded tril) is gone with them:
    # the graph would otherwise keep, load and store it for nothing.
    used = {v for n in kept for v in n.input_ids()} | set(graph.output_ids())
    for vid in made:
        if vid not in used:
            del graph.constants[vid]
    return graph
