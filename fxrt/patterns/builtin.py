"""The built-in patterns of a decoder block, registered when :mod:`fxrt.patterns` is imported.

Each matcher accepts the math, in the spellings models trace to (checked on Llama, Qwen2, Qwen3,
Mistral, Gemma and Phi-3 from ``transformers``, and on hand-written blocks in the tests):

``add_rms_norm`` / ``rms_norm``
    ``x * rsqrt(mean(x^2, -1, keepdim) + eps)``; ``x^2`` as ``pow(x, 2)`` or ``x * x``; ``eps``
    inside the root, or outside it as ``x / (sqrt(mean) + eps)``; then optionally a weight ``w``
    (either side of the product) or ``(1 + w)`` as Gemma writes it. ``add_rms_norm`` also takes the
    residual add that makes ``x`` (``x = a + b``, read again later): one call returns the norm and
    the sum. The norm is over the last dimension; the weight is 1-D of its size.
``rotary``
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[..., h:], x[..., :h])``,
    the interleaved form ``stack(-x[..., 1::2], x[..., ::2]).flatten(-2)``, and partial rotary
    embeddings (``cat(rope(x[..., :r]), x[..., r:])``). The query's and the key's chains that
    share ``cos`` and ``sin`` become one call.
``rotary_complex``
    the same rotation written as a complex product, ``view_as_real(view_as_complex(x.float()
    .reshape(..., -1, 2)) * freqs_cis).flatten(3).type_as(x)`` (Meta's Llama), or multiplied out
    on real ``(cos, sin)`` pairs with ``select``/``mul``/``sub``/``add``/``stack`` (gpt-fast);
    q's and k's chains over the same frequencies (or equal views of them) become one call
    (:mod:`fxrt.patterns.rotary_complex`).
``gated_mlp``
    ``act(gate) * up`` for ``act`` = ``silu`` (also spelled ``gate * sigmoid(gate)``) or
    ``gelu(approximate='tanh')``.
``gqa_attention``
    attention over K/V heads repeated for grouped-query attention (``repeat_kv``: ``x[:, :, None]
    .expand(b, h, n, s, d).reshape(b, h * n, s, d)``): the attention reads the un-repeated heads
    (query head ``i`` reads K/V head ``i // n``, as the repeat does), and the copies are gone.
    Anchored on the CPU's attention op, and on the ``view`` that ends SDPA's math chain, what
    SDPA traces to on a device with no fused kernel behind it under torch.compile (an NPU's:
    :func:`_match_sdpa_math`), whose only target is the NPU's.

Targets: on the CPU fxrt's own ops (``fxrt::rms_norm``, ``fxrt::add_rms_norm``, ``fxrt::rotary``,
``fxrt::rotary_complex``, ``fxrt::gated``; the attention op itself for ``gqa_attention``), for
float32 and bfloat16 tensors with the layouts their fast paths read; on Ascend NPUs
``torch_npu``'s fused ops (:mod:`fxrt.patterns.npu`), looked up only when a graph's tensors are
on an NPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..ir.graph import Node, Ref
from . import npu
from .match import CAST, WIDENED, GraphIndex, is_contiguous, last_dim
from .registry import Match, Target, View, register_pattern
from .rotary import match_rotary, rotary_guard
from .rotary_complex import match_rotary_complex, rotary_complex_guard

_MUL = "aten::mul.Tensor"
_ADD = "aten::add.Tensor"
_SLICE = "aten::slice.Tensor"
_RESHAPES = ("aten::view", "aten::_unsafe_view", "aten::reshape")
_ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _own(name: str):
    """fxrt's own op ``name``, when the extension that registers it is loaded."""

    def resolve() -> Any:
        from ..ops.own_ops import available_op

        return available_op(name)

    return resolve


# --- RMSNorm ------------------------------------------------------------------------------------


def _rms_core(index: GraphIndex, y: Any) -> tuple[Any, float, bool, list[Node]] | None:
    """``y = x * r`` (or ``x / d``) with ``r``/``d`` the root of x's mean square: ``(x, eps,
    eps_outside, nodes)``."""
    node = index.made_by(y, _MUL, "aten::div.Tensor")
    if node is None:
        return None
    pairs = list(index.operands(node)) if node.op.name == _MUL else [tuple(node.args[:2])]
    for x, r in pairs:
        if node.op.name == "aten::div.Tensor":
            found = _denominator(index, r)
        else:
            found = _inverse_root(index, r)
        if found is None:
            continue
        ms, eps, outside, chain = found
        if _mean_square_of(index, ms, x, chain):
            return x, eps, outside, [node, *chain]
    return None


def _inverse_root(index: GraphIndex, r: Any) -> tuple[Any, float, bool, list[Node]] | None:
    rs = index.only_for(r, "aten::rsqrt")
    if rs is not None:
        add = index.only_for(rs.args[0], _ADD)
        eps = _plus_number(index, add)
        if eps is not None:
            return add.args[0], eps, False, [rs, add]
        return None
    rec = index.only_for(r, "aten::reciprocal")
    if rec is not None:  # 1 / (sqrt(ms) + eps)
        found = _denominator(index, rec.args[0])
        return None if found is None else (*found[:3], [rec, *found[3]])
    return None


def _denominator(index: GraphIndex, d: Any) -> tuple[Any, float, bool, list[Node]] | None:
    """``sqrt(ms + eps)`` or ``sqrt(ms) + eps``."""
    sq = index.only_for(d, "aten::sqrt")
    if sq is not None:
        add = index.only_for(sq.args[0], _ADD)
        eps = _plus_number(index, add)
        return None if eps is None else (add.args[0], eps, False, [sq, add])
    add = index.only_for(d, _ADD)
    eps = _plus_number(index, add)
    if eps is None:
        return None
    sq = index.only_for(add.args[0], "aten::sqrt")
    return None if sq is None else (sq.args[0], eps, True, [add, sq])


def _plus_number(index: GraphIndex, add: Node | None) -> float | None:
    if add is None or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    eps = index.number(add.args[1])
    return eps if eps is not None and math.isfinite(eps) and eps >= 0 else None


def _mean_square_of(index: GraphIndex, ms: Any, x: Any, chain: list[Node]) -> bool:
    mean = index.only_for(ms, "aten::mean.dim")
    if mean is None or not isinstance(x, Ref):
        return False
    meta = index.meta(x)
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if meta is None or not last_dim(meta, mean.args[1]) or keepdim is not True:
        return False
    if mean.kwargs.get("dtype") is not None:
        return False
    sq = index.only_for(mean.args[0], "aten::pow.Tensor_Scalar", _MUL)
    if sq is None or sq.args[0] != x:
        return False
    if sq.op.name == _MUL and sq.args[1] != x:
        return False
    if sq.op.name != _MUL and index.number(sq.args[1]) != 2.0:
        return False
    chain.extend([mean, sq])
    return True


def _weighted(index: GraphIndex, anchor: Node) -> tuple[Any, Any, float, list[Node]] | None:
    """``anchor`` = ``y * w`` or ``y * (w + 1)``: ``(y, w, offset, nodes)``."""
    for y, w in index.operands(anchor):
        wm = index.meta(w)
        ym = index.meta(y)
        if wm is None or ym is None or len(wm.shape) != 1 or not ym.shape:
            continue
        if wm.shape[0] != ym.shape[-1]:
            continue
        plus = index.only_for(w, _ADD)
        offset = _plus_number(index, plus) if plus is not None else None
        if offset is not None and index.meta(plus.args[0]) is not None:
            return y, plus.args[0], offset, [anchor, plus]
        return y, w, 0.0, [anchor]
    return None


def _widened_core(index: GraphIndex, y: Any) -> tuple[Any, float, bool, list[Node]] | None:
    """``y`` = the norm of ``x.float()`` cast back to ``x``'s dtype (bfloat16), as Llama-family
    models write it: the core, on the low-precision ``x``, with the two casts."""
    back = index.cast(y, WIDENED)
    if back is None:
        return None
    core = _rms_core(index, back.args[0])
    if core is None:
        return None
    x32, eps, outside, nodes = core
    up = index.cast(x32, (torch.float32,), only=False)
    if up is None or index.meta(up.args[0]).dtype != index.meta(y).dtype:
        return None
    if index.uses[x32.id] != 2 or x32.id in index.returned:  # the square and the product
        return None
    return up.args[0], eps, outside, [back, *nodes, up]


def match_rms_norm(node: Node, index: GraphIndex) -> Match | None:
    weight, offset, extra = None, 0.0, []
    y = Ref(node.outputs[0])
    core = _rms_core(index, y)
    if core is None:
        weighted = _weighted(index, node) if node.op.name == _MUL else None
        if weighted is None:
            return None
        y, weight, offset, extra = weighted
        if index.uses[y.id] != 1 or y.id in index.returned:
            return None
        core = _rms_core(index, y)
        widened = core is None
        core = core or _widened_core(index, y)
        if core is None:
            return None
    elif _weight_follows(index, node):
        return None  # the weighted product after it is the anchor
    else:
        widened = False
    x, eps, outside, nodes = core
    # widened: the norm of a bfloat16 x computed in float32 (what fxrt::rms_norm computes for a
    # bfloat16 input); the guards fuse a bfloat16 norm only then, never a chain that rounds each
    # step to bfloat16.
    return Match(
        (x, weight, eps, offset, outside), {}, [node.outputs[0]], [*extra, *nodes],
        info={"x": x, "widened": widened},
    )  # fmt: skip


def _weight_follows(index: GraphIndex, node: Node) -> bool:
    """A weighted product reads the norm's result (through the cast back to bfloat16, as
    Llama-family models write it): that product is the anchor."""
    v = node.outputs[0]
    readers = index.readers.get(v, [])
    if index.uses[v] != 1 or v in index.returned:
        return False
    if readers[0].op.name == CAST and index.cast(Ref(readers[0].outputs[0]), WIDENED, False):
        v = readers[0].outputs[0]
        readers = index.readers.get(v, [])
        if index.uses[v] != 1 or v in index.returned:
            return False
    return readers[0].op.name == _MUL and _weighted(index, readers[0]) is not None


def _rms_guard(match: Match, index: GraphIndex) -> bool:
    x, weight, _, offset = match.args[:4]
    meta = index.meta(x)
    return (
        index.is_float_cpu(x, Ref(match.results[0]), *([] if weight is None else [weight]))
        and (meta.dtype is torch.float32 or (match.info["widened"] and offset == 0.0))
        and meta is not None
        and is_contiguous(meta)
        and is_contiguous(index.graph.values[match.results[0]].meta)
    )


def match_add_rms_norm(node: Node, index: GraphIndex) -> Match | None:
    m = match_rms_norm(node, index)
    if m is None:
        return None
    x = m.args[0]
    add = index.made_by(x, _ADD)
    if add is None or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
        return None
    a, b = add.args
    am, bm, xm = index.meta(a), index.meta(b), index.meta(x)
    if am is None or bm is None or am.shape != xm.shape or bm.shape != xm.shape:
        return None
    return Match((a, b, *m.args[1:]), {}, [m.results[0], x.id], [add, *m.nodes], info=m.info)


def _add_rms_guard(match: Match, index: GraphIndex) -> bool:
    a, b, weight, _, offset = match.args[:5]
    return (
        index.is_float_cpu(a, b, Ref(match.results[1]), *([] if weight is None else [weight]))
        and (index.meta(a).dtype is torch.float32 or (match.info["widened"] and offset == 0.0))
        and all(is_contiguous(index.meta(t)) for t in (a, b))
        and all(is_contiguous(index.graph.values[r].meta) for r in match.results)
    )


# --- gated MLP ----------------------------------------------------------------------------------


def match_gated(node: Node, index: GraphIndex) -> Match | None:
    for a, up in index.operands(node):
        act = index.only_for(a, "aten::silu", "aten::gelu", "aten::mul.Tensor")
        if act is None:
            continue
        gate = act.args[0]
        if act.op.name == "aten::gelu":
            if (
                act.kwargs.get("approximate", act.args[1] if len(act.args) > 1 else "none")
                != "tanh"
            ):
                continue
            name = "gelu_tanh"
        elif act.op.name == _MUL:  # gate * sigmoid(gate)
            sig = None
            for g, s in index.operands(act):
                sig = index.only_for(s, "aten::sigmoid")
                if sig is not None and sig.args[0] == g:
                    gate = g
                    break
                sig = None
            if sig is None:
                continue
            name = "silu"
            nodes = [node, act, sig]
            return _gated_match(index, gate, up, name, node, nodes)
        else:
            name = "silu"
        m = _gated_match(index, gate, up, name, node, [node, act])
        if m is not None:
            return m
    return None


def _gated_match(
    index: GraphIndex, gate: Any, up: Any, name: str, node: Node, nodes: list[Node]
) -> Match | None:
    gm, um = index.meta(gate), index.meta(up)
    if gm is None or um is None or gm.shape != um.shape or gate == up:
        return None
    return Match((gate, up, name), {}, [node.outputs[0]], nodes)


def _gated_guard(match: Match, index: GraphIndex) -> bool:
    gate, up, _ = match.args
    return index.is_float_cpu(gate, up, Ref(match.results[0])) and is_contiguous(
        index.graph.values[match.results[0]].meta
    )


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
    if node.op.name != _ATTENTION:
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


def _gqa_guard(match: Match, index: GraphIndex) -> bool:
    # SDPA's math spelling never traces on the CPU (its SDPA is the flash op); the CPU op's
    # output layout is not that chain's.
    return not match.info.get("math") and index.is_float32_cpu(*match.args[:3])


# --- registration -------------------------------------------------------------------------------

BUILTIN = ("add_rms_norm", "rms_norm", "rotary", "rotary_complex", "gated_mlp", "gqa_attention")


def register_builtins() -> None:
    register_pattern(
        "add_rms_norm", match_add_rms_norm,
        {"cpu": Target(_own("add_rms_norm"), _add_rms_guard), "npu": npu.add_rms_norm},
        anchors=[_MUL, "aten::div.Tensor"], doc="residual add + RMSNorm", _builtin=True,
    )  # fmt: skip
    register_pattern(
        "rms_norm", match_rms_norm,
        {"cpu": Target(_own("rms_norm"), _rms_guard), "npu": npu.rms_norm},
        anchors=[_MUL, "aten::div.Tensor"], doc="RMSNorm", _builtin=True,
    )  # fmt: skip
    register_pattern(
        "rotary", match_rotary,
        {"cpu": Target(_own("rotary"), rotary_guard), "npu": npu.rotary},
        anchors=[_ADD], doc="rotary embedding of q and k", _builtin=True,
    )  # fmt: skip
    register_pattern(
        "rotary_complex", match_rotary_complex,
        {"cpu": Target(_own("rotary_complex"), rotary_complex_guard), "npu": npu.rotary_complex},
        anchors=["aten::view_as_real", "aten::stack"],
        doc="rotary embedding of q and k as a complex product", _builtin=True,
    )  # fmt: skip
    register_pattern(
        "gated_mlp", match_gated,
        {"cpu": Target(_own("gated"), _gated_guard), "npu": npu.gated},
        anchors=[_MUL], doc="act(gate) * up (SiLU, GELU-tanh)", _builtin=True,
    )  # fmt: skip
    register_pattern(
        "gqa_attention", match_gqa,
        {"cpu": Target(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                       _gqa_guard), "npu": npu.attention},
        anchors=[_ATTENTION, "aten::view"], doc="attention over un-repeated K/V heads",
        _builtin=True,
    )  # fmt: skip


__all__ = ["BUILTIN", "register_builtins"]
