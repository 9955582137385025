"""Arena slots handed over in place: a pointwise op's result may take the slot of an operand that
dies at that op.

``y = gelu(x)`` where ``x`` is read by nothing after: eager frees ``x`` only once ``y`` exists, so
both are live at the ``gelu``, and a plain arena places them apart. But a pointwise op computes
each element of its result from the same element of its operands, reading that element before it
writes it, so writing ``y`` over ``x`` is what the op's in-place form (``gelu_``) does, and the
two can share bytes. Inductor reuses a dying buffer the same way. Chains of pointwise ops (an
MLP's activation and gate product, the residual adds, a norm's scaling) then keep one slot where
the plain placement kept two live at every step, which lowers the arena's size, the bytes a
compiled graph keeps between calls.

A result takes an operand's slot only when all of these hold (:func:`takes_over` is the part the
graph decides; :func:`fxrt.exec.arena.plan_arena` adds the rest):

* its op writes each element from the same elements of its operands: an ATen op tagged
  ``pointwise`` (``add``, ``mul``, ``gelu``, ``where``, ...; their ``out=`` kernels are
  TensorIterator loops, which take an output that is exactly an input, as in ``add_``), or one
  of fxrt's own ops in :data:`OWN_POINTWISE`;
* the operand has the result's shape, strides and dtype, and both are dense (their storage holds
  exactly their elements): element ``i`` of one is element ``i`` of the other, so no element is
  written before it is read. The operand is the slot's value or a chain of views of it (a
  matmul's result reshaped to 3-d), which, being dense, covers the whole storage;
* the slot ends at this op (its alias set, views included, is freed right after it), neither
  value is shared with another stream, and the slot's bytes are free of every other slot live
  while the result is.

:func:`takes_over` lists the slots (their values: the storages' owners) a node's result may
take over; :func:`fxrt.exec.arena_verify.verify_arena` checks each hand-over with it.
"""

from __future__ import annotations

import math

import torch

from ..ir.graph import Graph, Node, OpKind, Ref, TensorMeta
from ..ops.aliasing import output_aliases

# fxrt's own pointwise ops: gelu's out= form is a TensorIterator loop (ATen's GeluKernel, or
# aten::gelu.out; fxrt/_speedups/own_ops.h), gated's reads each lane block of its operands before
# it writes that block of the result, or computes into a new tensor and copies (own_decoder.h);
# tanh's reads each vector of its input before it writes that vector of the result, or is
# aten::tanh.out (own_ops.h).
OWN_POINTWISE = frozenset({"fxrt::gelu", "fxrt::gated", "fxrt::tanh"})


def _pointwise(node: Node) -> bool:
    op = node.op
    if op.name in OWN_POINTWISE:
        return True
    return op.kind is OpKind.ATEN and torch.Tag.pointwise in op.target.tags


def _dense(meta: TensorMeta) -> bool:
    numel = math.prod(meta.shape)
    return meta.storage_nbytes == numel * meta.dtype.itemsize and numel > 0


def same_elements(a: TensorMeta | None, b: TensorMeta | None) -> bool:
    """Element ``i`` of ``a`` and of ``b`` sit at the same byte of equal, dense storages."""
    return (
        a is not None
        and b is not None
        and a.is_static
        and b.is_static
        and (a.shape, a.stride, a.dtype, a.storage_nbytes)
        == (b.shape, b.stride, b.dtype, b.storage_nbytes)
        and _dense(a)
    )


def candidates(graph: Graph, node: Node) -> list[int]:
    """The value ids of ``node``'s operands that its result may be written over, as far as the op
    and the geometry decide (the planner checks the lifetimes and the bytes)."""
    if len(node.outputs) != 1 or not _pointwise(node):
        return []
    result = graph.values[node.outputs[0]].meta
    found = []
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, Ref) and a.id not in found:
            if same_elements(graph.values[a.id].meta, result):
                found.append(a.id)
    return found


def storage_owner(graph: Graph, made_by: dict[int, int], value: int, limit: int = 8) -> int:
    """The value that owns ``value``'s storage when ``value`` is it or a chain of up to ``limit``
    views of it (each made by a node whose only output aliases exactly one input: ``view``,
    ``_unsafe_view``, ...), or -1. A dense operand (:func:`same_elements`) of a view chain is
    all of the owner's storage, from its first byte, only when it has as many bytes: the planner
    compares them (a view's metadata does not hold its storage offset)."""
    for _ in range(limit + 1):
        node_index = made_by.get(value)
        if node_index is None:
            return -1
        node = graph.nodes[node_index]
        aliases = output_aliases(graph, node)
        if len(node.outputs) != 1 or not aliases[0]:
            return value  # a fresh storage
        if len(aliases[0]) != 1:
            return -1
        value = aliases[0][0]
    return -1


def takes_over(graph: Graph, made_by: dict[int, int], index: int) -> list[int]:
    """The storage owners (arena slot values) that node ``index``'s result may take over."""
    found = []
    for operand in candidates(graph, graph.nodes[index]):
        owner = storage_owner(graph, made_by, operand)
        if owner >= 0 and owner not in found:
            found.append(owner)
    return found


__all__ = ["OWN_POINTWISE", "candidates", "same_elements", "storage_owner", "takes_over"]
