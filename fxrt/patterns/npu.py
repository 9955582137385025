"""The built-in patterns' targets on Ascend NPUs: ``torch_npu``'s fused ops.

They are looked up when a graph whose tensors are on an NPU is compiled, as ``torch.ops.npu.*``
(the ops ``torch_npu`` registers when it is imported, which it must be for NPU tensors to exist);
nothing here imports ``torch_npu``. An op this ``torch_npu`` lacks, or a match the op cannot
express, keeps the ATen ops:

=================  ==============================================  ==============================
pattern            op                                              when
=================  ==============================================  ==============================
``rms_norm``       ``npu_rms_norm(x, gamma, epsilon)`` (result 0)  a weight, no offset, eps inside
``add_rms_norm``   ``npu_add_rms_norm(x1, x2, gamma, epsilon)``    the same
                   (results 0 and 2)
``rotary``         ``npu_rotary_mul(x, cos, sin, mode)``, one per  every feature rotated
                   tensor (mode ``half`` or ``interleave``)
``gated_mlp``      ``npu_swiglu(x, -1)``                           SiLU, gate and up the two
                                                                   halves of one tensor
=================  ==============================================  ==============================
"""

from __future__ import annotations

from typing import Any

import torch

from ..ir.graph import Ref
from .registry import Match, Target


def _npu_op(name: str):
    def resolve() -> Any:
        try:
            return getattr(torch.ops.npu, name).default
        except (AttributeError, RuntimeError):
            return None

    return resolve


def _rms_args(match: Match, first: int) -> tuple[Any, ...] | None:
    weight, eps, offset, outside = match.args[first : first + 4]
    if weight is None or offset != 0.0 or outside:
        return None
    return (*match.args[:first], weight, eps)


def _adapt_rms_norm(match: Match, _index: Any) -> Match | None:
    args = _rms_args(match, 1)
    return None if args is None else Match(args, {}, [match.results[0], None], match.nodes)


def _adapt_add_rms_norm(match: Match, _index: Any) -> Match | None:
    args = _rms_args(match, 2)
    y, x = match.results
    return None if args is None else Match(args, {}, [y, None, x], match.nodes)


def _adapt_rotary(match: Match, _index: Any) -> list[Match] | None:
    q, k, cos, sin, features, interleaved = match.args
    if features != -1:
        return None
    mode = "interleave" if interleaved else "half"
    calls = []
    for x, r in zip((q, k), match.results):
        if r is not None:
            calls.append(Match((x, cos, sin, mode), {}, [r], match.nodes, at=match.at))
    return calls


def _adapt_gated(match: Match, index: Any) -> Match | None:
    gate, up, activation = match.args
    if activation != "silu" or not isinstance(gate, Ref) or not isinstance(up, Ref):
        return None
    base = _halves(index, gate, up)
    return None if base is None else Match((base, -1), {}, match.results, match.nodes)


def _halves(index: Any, gate: Ref, up: Ref) -> Ref | None:
    """The tensor whose last dimension's two halves ``gate`` and ``up`` are (``chunk(2, -1)``,
    which traces to ``split``, or two slices), else None."""
    if not index.meta(gate).shape:
        return None
    n = index.meta(gate).shape[-1]
    split = index.producer.get(gate.id)
    if (
        split is not None
        and split.op.name in ("aten::split.Tensor", "aten::split_with_sizes")
        and split.outputs == [gate.id, up.id]
    ):
        base, sizes = split.args[0], split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        meta = index.meta(base)
        if meta is None or dim not in (-1, len(meta.shape) - 1) or meta.shape[-1] != 2 * n:
            return None
        return base if sizes in (n, [n, n], (n, n)) else None
    halves = [index.made_by(t, "aten::slice.Tensor") for t in (gate, up)]
    if None in halves or halves[0].args[0] != halves[1].args[0]:
        return None
    base = halves[0].args[0]
    meta = index.meta(base)
    if meta is None or meta.shape[-1] != 2 * n:
        return None
    for h, (lo, hi) in zip(halves, [(0, n), (n, 2 * n)]):
        dim, start, end = (list(h.args[1:4]) + [None] * 3)[:3]
        end = meta.shape[-1] if end is None or end >= meta.shape[-1] else end
        if dim not in (-1, len(meta.shape) - 1) or (start, end) != (lo, hi):
            return None
        if h.args[4:] not in ((), (1,)):
            return None
    return base


rms_norm = Target(_npu_op("npu_rms_norm"), adapt=_adapt_rms_norm)
add_rms_norm = Target(_npu_op("npu_add_rms_norm"), adapt=_adapt_add_rms_norm)
rotary = Target(_npu_op("npu_rotary_mul"), adapt=_adapt_rotary)
gated = Target(_npu_op("npu_swiglu"), adapt=_adapt_gated)

__all__ = ["add_rms_norm", "gated", "rms_norm", "rotary"]
