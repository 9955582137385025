"""The built-in ``gqa_attention`` pattern (registered in :mod:`fxrt.patterns.builtin`): attention
over K/V heads repeated for grouped-query attention, read un-repeated.

The same for ``gqa_softcap_attention`` over fxrt's soft-capped attention (``fxrt::softcap_sdpa``,
which :mod:`fxrt.passes.fuse_attention` makes of Gemma-2's written-out attention).

Two anchors: the CPU's attention op (``_scaled_dot_product_flash_attention_for_cpu``, what SDPA
runs there), and the ``view`` that ends SDPA's math chain, what SDPA traces to on a device with
no fused kernel behind it under torch.compile (an NPU's), whose only target is the NPU's
(:func:`_match_sdpa_math`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..ir.graph import Node, Ref
from .match import GraphIndex
from .registry import Match, View

_ADD = "aten::add.Tensor"
_RESHAPES = ("aten::view", "aten::_unsafe_view", "aten::reshape")
ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"
SOFTCAP_ATTENTION = "fxrt::softcap_sdpa"  # soft-capped scores (fxrt.passes.fuse_attention)


# --- grouped-query attention --------------------------------------------------------------------


def _unrepeated(index: GraphIndex, x: Any, heads: int) -> tuple[Any, list[Node]] | None:
    """``x`` = K/V heads repeated ``n`` times each (``repeat_kv``): the un-repeated value, or a
    :class:`View` of it. Two layouts: ``[b, hk, s, d]`` repeated at dim 2 (transformers), or
    ``[b, s, hk, d]`` repeated at dim 3 and then ``transpose(1, 2)`` (Meta's reference code),
    whose un-repeated heads are that transpose of the source."""
    transpose = index.only_for(x, "aten::transpose.int")
    before = transpose is not None
    if before:
        if sorted(d % 4 for d in transpose.args[1:3]) != [1, 2]:
            return None
        x = transpose.args[0]
    view = index.only_for(x, *_RESHAPES)
    if view is None:
        return None
    src, chain = view.args[0], [view]
    clone = index.only_for(src, "aten::clone")
    if clone is not None:
        src, chain = clone.args[0], [*chain, clone]
    expand = index.only_for(src, "aten::expand")
    if expand is None:
        return None
    unsq = index.only_for(expand.args[0], "aten::unsqueeze")
    if unsq is None:
        return None
    base = unsq.args[0]
    bm, em = index.meta(base), index.meta(Ref(expand.outputs[0]))
    if bm is None or em is None or len(bm.shape) != 4 or len(em.shape) != 5:
        return None
    if unsq.args[1] % 5 != (3 if before else 2):
        return None
    if before:  # [b, s, hk, n, d]
        b, s, hk, n, d = em.shape
        if (b, s, hk, d) != tuple(bm.shape) or hk * n != heads:
            return None
        shape, stride = list(bm.shape), list(bm.stride)
        shape[1], shape[2], stride[1], stride[2] = shape[2], shape[1], stride[2], stride[1]
        meta = dataclasses.replace(bm, shape=tuple(shape), stride=tuple(stride))
        view_of = View(torch.ops.aten.transpose.int, (base, 1, 2), meta)
        return view_of, [transpose, *chain, expand, unsq]
    b, hk, n, s, d = em.shape
    if (b, hk, s, d) != tuple(bm.shape) or hk * n != heads:
        return None
    return base, [*chain, expand, unsq]


def match_gqa(node: Node, index: GraphIndex) -> Match | None:
    if node.op.name not in (ATTENTION, SOFTCAP_ATTENTION):
        return _match_sdpa_math(node, index)
    q, k, v = node.args[:3]
    qm = index.meta(q)
    if qm is None or len(qm.shape) != 4:
        return None
    heads = qm.shape[1]
    ku, vu = _unrepeated(index, k, heads), _unrepeated(index, v, heads)
    if ku is None or vu is None:
        return None
    args = (q, ku[0], vu[0], *node.args[3:])
    return Match(args, dict(node.kwargs), list(node.outputs), [node, *ku[1], *vu[1]])


def _match_sdpa_math(node: Node, index: GraphIndex) -> Match | None:
    """``scaled_dot_product_attention`` as it traces on a device with no fused kernel of its
    own behind SDPA (a PrivateUse1 backend's, ``torch_npu``'s under torch.compile): q and k^T
    each scaled by the root of the scale, two ``bmm``, a mask added as ``where(keep, 0, -inf)``
    (a boolean mask, or the causal ``tril``) or as a constant of zeros and -inf, and
    ``_safe_softmax``; ``node`` is the ``view`` of the second ``bmm``. The match is in the CPU
    op's terms with ``attn_mask`` the boolean keep-mask, or the constant; ``info["math"]``."""
    bmm2 = index.only_for(node.args[0], "aten::bmm")
    if bmm2 is None:
        return None
    (probs, pn), (vr, vn) = (_through_expand(index, x) for x in bmm2.args[:2])
    softmax = index.only_for(probs, "aten::_safe_softmax")
    if softmax is None or len(softmax.args) != 2 or softmax.args[1] not in (-1, 3):
        return None
    scores, mask, chain = softmax.args[0], None, [node, bmm2, *pn, *vn, softmax]
    add = index.only_for(scores, _ADD)
    if add is not None:
        if add.kwargs.get("alpha", 1) != 1:
            return None
        scores, mask = next(
            ((x, m) for x, m in index.operands(add) if index.made_by(x, *_RESHAPES)), (None, None)
        )
        mask = _keep_mask(index, mask)
        if mask is None:
            return None
        chain.append(add)
    view = index.only_for(scores, *_RESHAPES)
    bmm1 = None if view is None else index.only_for(view.args[0], "aten::bmm")
    if bmm1 is None:
        return None
    (qs, qn), (kts, kn) = (_through_expand(index, x) for x in bmm1.args[:2])
    qmul, kmul = index.only_for(qs, "aten::mul.Scalar"), index.only_for(kts, "aten::mul.Scalar")
    if qmul is None or kmul is None:
        return None
    root = index.number(qmul.args[1])
    if root is None or root != index.number(kmul.args[1]) or not root > 0:
        return None
    kt = index.only_for(kmul.args[0], "aten::transpose.int")
    if kt is None or sorted(d % 4 for d in kt.args[1:3]) != [2, 3]:
        return None
    q = qmul.args[0]
    qm, om = index.meta(q), index.meta(Ref(node.outputs[0]))
    if qm is None or om is None or len(qm.shape) != 4 or len(om.shape) != 4:
        return None
    heads = qm.shape[1]
    ku, vu = _unrepeated(index, kt.args[0], heads), _unrepeated(index, vr, heads)
    if ku is None or vu is None:
        return None
    b, _, length, _ = qm.shape
    keys, dv = index.meta(ku[0]).shape[2], index.meta(vu[0]).shape[3]
    sm = index.meta(Ref(view.outputs[0]))
    if tuple(sm.shape) != (b, heads, length, keys) or tuple(om.shape) != (b, heads, length, dv):
        return None
    chain += [view, bmm1, *qn, *kn, qmul, kmul, kt, *ku[1], *vu[1]]
    kwargs = {"attn_mask": mask, "scale": root * root}
    return Match((q, ku[0], vu[0], 0.0, False), kwargs, [node.outputs[0], None], chain,
                 info={"math": True})  # fmt: skip


def _through_expand(index: GraphIndex, x: Any) -> tuple[Any, list[Node]]:
    """``x`` = ``view(y)`` (matmul's decomposition: a 4-D operand as a batch of matrices),
    through the contiguous copy it makes of a strided ``y`` and a broadcast to ``y``'s own shape
    (when no pass removed it), each read by the chain alone: ``(y, those nodes)``; ``(None,
    [])`` otherwise."""
    view = index.only_for(x, *_RESHAPES)
    if view is None:
        return None, []
    y, nodes = view.args[0], [view]
    clone = index.only_for(y, "aten::clone")
    if clone is not None:
        y, nodes = clone.args[0], [*nodes, clone]
    expand = index.only_for(y, "aten::expand")
    if expand is not None:
        if index.meta(expand.args[0]).shape != index.meta(y).shape:
            return None, []  # a real broadcast
        y, nodes = expand.args[0], [*nodes, expand]
    return y, nodes


def _keep_mask(index: GraphIndex, m: Any) -> Any:
    """The mask SDPA's math adds to the scores: ``where(keep, 0, -inf)`` (``keep`` a boolean
    value: the mask's or the causal ``tril``), or a constant of zeros and -inf (the same,
    folded). The boolean keep-mask, or the constant; None for any other mask."""
    where = index.made_by(m, "aten::where.self")
    if where is not None:
        keep, zero, inf = where.args[:3]
        km = index.meta(keep)
        if km is None or km.dtype != torch.bool:
            return None
        if _scalar(index, zero) == 0.0 and _scalar(index, inf) == -math.inf:
            return keep
        return None
    if not isinstance(m, Ref) or m.id not in index.graph.constants:
        return None
    c = index.graph.constants[m.id]
    if not isinstance(c, torch.Tensor) or not c.is_floating_point():
        return None
    return m if bool(((c == 0) | (c == -math.inf)).all()) else None


def _scalar(index: GraphIndex, x: Any) -> float | None:
    """The number a ``scalar_tensor`` node makes (or a folded 0-d constant)."""
    node = index.made_by(x, "aten::scalar_tensor")
    if node is not None:
        return index.number(node.args[0])
    c = index.graph.constants.get(x.id) if isinstance(x, Ref) else None
    if isinstance(c, torch.Tensor) and c.dim() == 0:
        return float(c)
    return None


def gqa_guard(match: Match, index: GraphIndex) -> bool:
    # SDPA's math spelling never traces on the CPU (its SDPA is the flash op); the CPU op's
    # output layout is not that chain's.
    return not match.info.get("math") and index.is_float32_cpu(*match.args[:3])


__all__ = ["ATTENTION", "SOFTCAP_ATTENTION", "gqa_guard", "match_gqa"]
