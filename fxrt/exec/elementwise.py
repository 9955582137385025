"""OUT's inline elementwise form: which arena writes the compiled loop makes with a loop of its own.

An ``add``, ``sub`` (alpha 1), ``mul`` or ``clamp_min`` (what ``relu`` runs as) of float32 CPU
tensors of at most :data:`MAX_ELEMENTS` elements, whose out= call would spend most of its time
building a TensorIterator (about 0.5 us a call), is written by the compiled loop's own loop
(``fxrt/_speedups/elementwise.h``) with the same result, bit for bit: one IEEE operation per
element, a number operand rounded to float first as ATen's kernels read it. Operands are dense
(contiguous) tensors of the result's size, a dense tensor that covers its trailing dimensions (a
bias, repeated per row), or, for the second, a number. Decided here, at lowering, from the
static metadata (the listing shows ``(inline add)``); the compiled loop checks the actual tensors
on every call and runs the out= op when they differ. The Python loop runs the out= op: the
same values.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..ir.graph import Graph, Op, Ref, TensorMeta, is_contiguous
from .arena import Slot

# At most this many elements: where ATen would split the work between threads (its GRAIN_SIZE).
MAX_ELEMENTS = 32768

_FORMS = {
    "aten::add.out": "add",
    "aten::sub.out": "sub",
    "aten::mul.out": "mul",
    "aten::clamp_min.out": "clamp_min",
}


def elementwise_form(graph: Graph, slot: Slot) -> str:
    """The inline form of the out= call that writes ``slot`` ("add", "sub", "mul",
    "clamp_min"), or "" when it has none."""
    form = _FORMS.get(Op.of(slot.out_target).name)
    if form is None:
        return ""
    out = graph.values[slot.value].meta
    if not _dense_float(out) or _numel(out) > MAX_ELEMENTS or _numel(out) == 0:
        return ""
    args, kwargs = slot.out_args, dict(slot.out_kwargs)
    kwargs.pop("out", None)
    names = ("self", "min") if form == "clamp_min" else ("self", "other", "alpha")
    if len(args) > len(names) or any(k not in names[len(args) :] for k in kwargs):
        return ""
    bound = dict(zip(names, args)) | kwargs
    a, b = bound.get("self"), bound.get(names[1])
    alpha = bound.get("alpha", 1)
    if not _number(alpha) or alpha != 1:
        return ""
    rows_a = _operand(graph, a, out)
    if rows_a is None:
        return ""
    if _number(b):
        return form if rows_a == "full" else ""
    if form == "clamp_min":
        return ""
    rows_b = _operand(graph, b, out)
    if rows_b is None or (rows_a == "row" and rows_b == "row"):
        return ""
    return form


def _number(x: Any) -> bool:
    return type(x) in (int, float)  # not a bool


def _numel(meta: TensorMeta) -> int:
    return math.prod(meta.shape)


def _dense_float(meta: TensorMeta | None) -> bool:
    return (
        meta is not None
        and meta.is_static
        and meta.dtype == torch.float32
        and meta.device == "cpu"
        and is_contiguous(meta)
    )


def _operand(graph: Graph, x: Any, out: TensorMeta) -> str | None:
    """ "full" for a dense float32 tensor of the result's elements, "row" for one that covers its
    trailing dimensions, None otherwise."""
    if not isinstance(x, Ref):
        return None
    meta = graph.values[x.id].meta
    if not _dense_float(meta):
        return None
    shape = list(meta.shape)
    while shape and shape[0] == 1:
        shape.pop(0)
    trailing = tuple(out.shape[len(out.shape) - len(shape) :])
    if len(shape) > len(out.shape) or tuple(shape) != trailing:
        return None
    return "full" if _numel(meta) == _numel(out) else "row"


__all__ = ["MAX_ELEMENTS", "elementwise_form"]
