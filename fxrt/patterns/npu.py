"""The built-in patterns' targets on Ascend NPUs: ``torch_npu``'s fused ops.

They are looked up when a graph whose tensors are on an NPU is compiled, as ``torch.ops.npu.*``
(the ops ``torch_npu`` registers when it is imported, which it must be for NPU tensors to exist);
nothing here imports ``torch_npu``. An op this ``torch_npu`` lacks, or a match the op cannot
express, keeps the ATen ops:

=================  ==============================================  ==============================
pattern            op                                              when
=================  ==============================================  ==============================
``layer_norm``     ``aten::native_layer_norm(x, [n], weight,       eps inside the root
                   bias, eps)`` (result 0), which ``torch_npu``
                   computes with its fused kernel
``rms_norm``       ``npu_rms_norm(x, gamma, epsilon)`` (result 0)  a weight, no offset, eps inside
``add_rms_norm``   ``npu_add_rms_norm(x1, x2, gamma, epsilon)``    the same
                   (results 0 and 2)
``rotary``         ``npu_rotary_mul(x, cos, sin, mode)``, one per  every feature rotated
                   tensor (mode ``half`` or ``interleave``)
``rotary_complex`` ``npu_rotary_mul(x, cos, sin, "interleave")``,   4-D q/k, the table's rows
                   one per tensor; ``cos``/``sin`` the table's     along one of their first three
                   halves repeated per pair (made before the call) dims
``gated_mlp``      ``npu_swiglu(x, -1)``                           SiLU, gate and up the two
                                                                   halves of one tensor
``gqa_attention``  ``npu_fusion_attention(q, k, v, heads, "BNSD",  SDPA as it traces on the NPU
                   atten_mask=, scale=)`` (result 0) over the      (its math: the CPU has its
                   un-repeated K/V heads; the keep-mask negated    own op), no mask or a boolean
                   before the call                                 or causal one
=================  ==============================================  ==============================

Where the fused op reads a value in another form than the graph holds it (the masked-out mask
for the graph's keep-mask, the frequency table per feature), the adaptation makes it just before
the call (:class:`~fxrt.patterns.Made`): one small kernel a call, against the chain's five to
twenty.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..ir.graph import Ref, is_contiguous
from .registry import Made, Match, Target

aten = torch.ops.aten


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


def _adapt_layer_norm(match: Match, index: Any) -> Match | None:
    x, weight, bias, eps, root = match.args
    meta = index.meta(x)
    if root.startswith("sqrt_eps") or meta is None or not meta.shape:
        return None
    return Match((x, [meta.shape[-1]], weight, bias, eps), {}, [*match.results, None, None],
                 match.nodes)  # fmt: skip


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


def _adapt_rotary_complex(match: Match, index: Any) -> list[Match] | None:
    """``x * freqs`` over pairs of features, as ``npu_rotary_mul``'s interleaved mode computes
    it (``x * cos + rotate_interleaved(x) * sin``) with ``cos``/``sin`` the table's two halves
    repeated per pair. The kernel takes 4-D tensors, the table's rows along one of x's first
    three dimensions (1S1D, 11SD or S11D)."""
    q, k, freqs = match.args
    fm = index.meta(freqs)
    xs = [(x, r) for x, r in zip((q, k), match.results) if r is not None]
    metas = [index.meta(x) for x, _ in xs]
    if fm is None or not fm.is_static or any(m is None or not m.is_static for m in metas):
        return None
    dtype = metas[0].dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if fm.dtype == torch.complex64:
        pairs, half = Made(aten.view_as_real.default, (freqs,)), tuple(fm.shape)
    elif fm.dtype == torch.float32 and fm.shape[-1] == 2:
        pairs, half = freqs, tuple(fm.shape[:-1])
    else:
        return None
    if len(half) > 4:
        return None
    table = (1,) * (4 - len(half)) + half  # the table's pairs, as 4-D
    rows = [d for d in range(3) if table[d] != 1]
    for m in metas:
        if len(m.shape) != 4 or m.dtype != dtype or table[-1] * 2 != m.shape[-1]:
            return None
        if len(rows) > 1 or (rows and table[rows[0]] != m.shape[rows[0]]):
            return None
    cos, sin = (_per_feature(pairs, i, table, dtype) for i in (0, 1))
    return [Match((x, cos, sin, "interleave"), {}, [r], match.nodes, at=match.at) for x, r in xs]


def _per_feature(pairs: Any, i: int, table: tuple[int, ...], dtype: torch.dtype) -> Made:
    """The pairs' component ``i`` (cos 0, sin 1) once per feature, ``table[:3] + (2 * n,)``, in
    ``dtype``: ``view(stack([c, c], -1))`` of ``c = pairs[..., i]``."""
    half = Made(aten.select.int, (pairs, -1, i))
    both = Made(aten.stack.default, ((half, half), -1))
    flat = Made(aten.view.default, (both, [*table[:3], 2 * table[3]]))
    if dtype == torch.float32:
        return flat
    return Made(aten._to_copy.default, (flat,), {"dtype": dtype})


def _adapt_attention(match: Match, index: Any) -> Match | None:
    """SDPA's math chain (``info["math"]``) as one ``npu_fusion_attention`` in the BNSD layout
    over the un-repeated K/V heads (the kernel reads query head ``i``'s keys at ``i // n``, as
    the repeat does); the mask is the kernel's (True: masked out): the keep-mask negated, or a
    folded mask's -inf entries. A 2-D or 4-D mask with one batch and head or all of them."""
    if not match.info.get("math"):
        return None
    q, k, v, dropout, causal = match.args
    metas = [index.meta(t) for t in (q, k, v)]
    if dropout != 0.0 or causal or any(m is None or len(m.shape) != 4 for m in metas):
        return None
    qm, km, _ = metas
    heads, kv_heads = qm.shape[1], km.shape[1]
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads % max(kv_heads, 1):
        return None
    kwargs: dict[str, Any] = {"scale": match.kwargs["scale"]}
    mask = match.kwargs["attn_mask"]
    if mask is not None:
        mm = index.meta(mask)
        b, length, keys = qm.shape[0], qm.shape[2], km.shape[2]
        lead = tuple(mm.shape[:-2])
        if tuple(mm.shape[-2:]) != (length, keys) or lead not in ((), (1, 1), (b, 1), (b, heads)):
            return None
        # the mask's own layout when it is contiguous (so symbolic sizes need no shape
        # function), else worked out (static sizes)
        meta = None
        if is_contiguous(mm):
            meta = dataclasses.replace(mm, dtype=torch.bool, storage_nbytes=_bytes(mm))
        elif not mm.is_static:
            return None
        if mm.dtype == torch.bool:
            kwargs["atten_mask"] = Made(aten.logical_not.default, (mask,), meta=meta)
        else:
            kwargs["atten_mask"] = Made(aten.eq.Scalar, (mask, float("-inf")), meta=meta)
    results = [match.results[0], *([None] * 6)]
    return Match((q, k, v, heads, "BNSD"), kwargs, results, match.nodes)


def _bytes(meta: Any) -> int | None:
    """The bytes of a new boolean tensor of ``meta``'s shape (None when symbolic)."""
    return math.prod(meta.shape) if meta.is_static else None


layer_norm = Target(aten.native_layer_norm.default, adapt=_adapt_layer_norm)
rms_norm = Target(_npu_op("npu_rms_norm"), adapt=_adapt_rms_norm)
add_rms_norm = Target(_npu_op("npu_add_rms_norm"), adapt=_adapt_add_rms_norm)
rotary = Target(_npu_op("npu_rotary_mul"), adapt=_adapt_rotary)
gated = Target(_npu_op("npu_swiglu"), adapt=_adapt_gated)
rotary_complex = Target(_npu_op("npu_rotary_mul"), adapt=_adapt_rotary_complex)
attention = Target(_npu_op("npu_fusion_attention"), adapt=_adapt_attention)

__all__ = [
    "add_rms_norm",
    "attention",
    "gated",
    "layer_norm",
    "rms_norm",
    "rotary",
    "rotary_complex",
]
