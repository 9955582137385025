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
``gated_mlp``
    ``act(gate) * up`` for ``act`` = ``silu`` (also spelled ``gate * sigmoid(gate)``) or
    ``gelu(approximate='tanh')``.
``gqa_attention``
    attention over K/V heads repeated for grouped-query attention (``repeat_kv``: ``x[:, :, None]
    .expand(b, h, n, s, d).reshape(b, h * n, s, d)``): the attention reads the un-repeated heads
    (query head ``i`` reads K/V head ``i // n``, as the repeat does), and the copies are gone.

Targets: on the CPU fxrt's own ops (``fxrt::rms_norm``, ``fxrt::add_rms_norm``, ``fxrt::rotary``,
``fxrt::gated``; the attention op itself for ``gqa_attention``), for float32 tensors with the
layouts their fast paths read; on Ascend NPUs ``torch_npu``'s fused ops (:mod:`fxrt.patterns.npu`),
looked up only when a graph's tensors are on an NPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..ir.graph import Node, Ref
from . import npu
from .match import GraphIndex, is_contiguous, last_dim
from .registry import Match, Target, register_pattern

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
        if core is None:
            return None
    elif _weight_follows(index, node):
        return None  # the weighted product after it is the anchor
    x, eps, outside, nodes = core
    return Match(
        (x, weight, eps, offset, outside), {}, [node.outputs[0]], [*extra, *nodes],
        info={"x": x},
    )  # fmt: skip


def _weight_follows(index: GraphIndex, node: Node) -> bool:
    readers = index.readers.get(node.outputs[0], [])
    return (
        index.uses[node.outputs[0]] == 1
        and node.outputs[0] not in index.returned
        and readers[0].op.name == _MUL
        and _weighted(index, readers[0]) is not None
    )


def _rms_guard(match: Match, index: GraphIndex) -> bool:
    x, weight = match.args[0], match.args[1]
    meta = index.meta(x)
    return (
        index.is_float32_cpu(x, Ref(match.results[0]))
        and (weight is None or index.is_float32_cpu(weight))
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
    return Match((a, b, *m.args[1:]), {}, [m.results[0], x.id], [add, *m.nodes])


def _add_rms_guard(match: Match, index: GraphIndex) -> bool:
    a, b, weight = match.args[:3]
    return (
        index.is_float32_cpu(a, b, Ref(match.results[1]))
        and (weight is None or index.is_float32_cpu(weight))
        and all(is_contiguous(index.meta(t)) for t in (a, b))
        and all(is_contiguous(index.graph.values[r].meta) for r in match.results)
    )


# --- rotary embeddings --------------------------------------------------------------------------


def _rope_chain(
    index: GraphIndex, node: Node
) -> tuple[Any, Any, Any, int, bool, list[Node]] | None:
    """``node`` = ``x * cos + rotate(x) * sin``: ``(x, cos, sin, rotated features, interleaved,
    nodes)``."""
    if node.op.name != _ADD or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    for left, right in index.operands(node):
        m1, m2 = index.only_for(left, _MUL), index.only_for(right, _MUL)
        if m1 is None or m2 is None:
            continue
        for x, cos in index.operands(m1):
            for rot, sin in index.operands(m2):
                found = _rotated(index, rot, x)
                if found is not None:
                    features, inter, chain = found
                    return x, cos, sin, features, inter, [node, m1, m2, *chain]
    return None


def _rotated(index: GraphIndex, rot: Any, x: Any) -> tuple[int, bool, list[Node]] | None:
    """``rot`` is rotate_half(x) or the interleaved rotation of x: (features, interleaved,
    nodes)."""
    xm = index.meta(x)
    if xm is None or not xm.shape or not isinstance(xm.shape[-1], int):
        return None
    d = xm.shape[-1]
    cat = index.only_for(rot, "aten::cat")
    if cat is not None:
        parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
        if len(parts) != 2 or dim not in (-1, len(xm.shape) - 1) or d % 2:
            return None
        neg = index.only_for(parts[0], "aten::neg")
        hi = neg and index.only_for(neg.args[0], _SLICE)
        lo = index.only_for(parts[1], _SLICE)
        if hi and lo and _is_slice(hi, x, d // 2, d, 1, xm) and _is_slice(lo, x, 0, d // 2, 1, xm):
            return d, False, [cat, neg, hi, lo]
        return None
    flat = index.only_for(rot, *_RESHAPES)
    stack = flat and index.only_for(flat.args[0], "aten::stack")
    if not stack or index.meta(rot).shape != xm.shape or len(stack.args[0]) != 2:
        return None
    if (stack.args[1] if len(stack.args) > 1 else 0) not in (-1, len(xm.shape)):
        return None
    neg = index.only_for(stack.args[0][0], "aten::neg")
    odd = neg and index.only_for(neg.args[0], _SLICE)
    even = index.only_for(stack.args[0][1], _SLICE)
    if odd and even and _is_slice(odd, x, 1, d, 2, xm) and _is_slice(even, x, 0, d, 2, xm):
        return d, True, [flat, stack, neg, odd, even]
    return None


def _is_slice(node: Node, x: Any, start: int, end: int, step: int, xm: Any) -> bool:
    args = list(node.args) + [None] * (5 - len(node.args))
    src, dim, lo, hi, st = args[:5]
    lo = 0 if lo is None else lo
    hi = xm.shape[-1] if hi is None or (isinstance(hi, int) and hi >= xm.shape[-1]) else hi
    st = 1 if st is None else st
    return src == x and dim in (-1, len(xm.shape) - 1) and (lo, hi, st) == (start, end, step)


def _rope_one(index: GraphIndex, node: Node) -> dict[str, Any] | None:
    """One tensor's rotary chain, partial rotary included; the value the caller sees is
    ``out``."""
    chain = _rope_chain(index, node)
    if chain is None:
        return None
    x, cos, sin, features, inter, nodes = chain
    out = node.outputs[0]
    src = x
    base = index.made_by(x, _SLICE, "aten::alias")
    xm = index.meta(x)
    readers = index.readers.get(out, [])
    if base is not None and len(readers) == 1 and readers[0].op.name == "aten::cat":
        # partial: cat(rope(x[..., :r]), x[..., r:]), x[..., r:] empty when r is every feature
        # (Phi-3's partial_rotary_factor=1; x[..., :r] is then an alias)
        cat = readers[0]
        whole = base.args[0]
        wm = index.meta(whole)
        parts = cat.args[0]
        dim = cat.args[1] if len(cat.args) > 1 else 0
        rest = len(parts) == 2 and parts[0] == Ref(out) and index.only_for(parts[1], _SLICE)
        if (
            wm is not None
            and rest
            and index.uses[out] == 1
            and out not in index.returned
            and dim in (-1, len(wm.shape) - 1)
            and (base.op.name == "aten::alias" or _is_slice(base, whole, 0, xm.shape[-1], 1, wm))
            and _is_slice(rest, whole, xm.shape[-1], wm.shape[-1], 1, wm)
        ):
            inside = {id(n) for n in nodes}
            if x.id not in index.returned and all(
                id(r) in inside for r in index.readers.get(x.id, [])
            ):
                nodes = [*nodes, base]  # the slice feeds only this chain
            return dict(x=whole, cos=cos, sin=sin, rot=features, inter=inter, out=cat.outputs[0],
                        nodes=[cat, rest, *nodes], partial=True)  # fmt: skip
    return dict(x=src, cos=cos, sin=sin, rot=features, inter=inter, out=out, nodes=nodes,
                partial=False)  # fmt: skip


def match_rotary(node: Node, index: GraphIndex) -> Match | None:
    first = _rope_one(index, node)
    if first is None:
        return None
    claimed = index.claimed
    second = None
    # The sibling chain (k for q): the next rotary chain over the same cos and sin.
    for reader in index.readers.get(first["cos"].id, []) if isinstance(first["cos"], Ref) else []:
        for cand in index.readers.get(reader.outputs[0], []):
            if cand is node or id(cand) in claimed or not index.before(node, cand):
                continue
            other = _rope_one(index, cand)
            if other is None or other["x"] == first["x"]:
                continue
            same = all(other[k] == first[k] for k in ("cos", "sin", "rot", "inter", "partial"))
            if same and (second is None or index.before(cand, second["anchor"])):
                second = {**other, "anchor": cand}
    features = -1 if not first["partial"] else first["rot"]
    args: tuple[Any, ...]
    if second is None:
        args = (first["x"], first["x"], first["cos"], first["sin"], features, first["inter"])
        return Match(args, {}, [first["out"], None], first["nodes"])
    args = (first["x"], second["x"], first["cos"], first["sin"], features, first["inter"])
    # After q's chain when k is ready by then (a reader of q's result may come before k's chain
    # ends, as Phi-3's cat does); the pass checks the place either way.
    k_made = index.producer.get(second["x"].id) if isinstance(second["x"], Ref) else None
    at = first["nodes"][0] if k_made is None or index.before(k_made, first["nodes"][0]) else None
    nodes = first["nodes"] + second["nodes"]
    return Match(args, {}, [first["out"], second["out"]], nodes, at=at)


def _rotary_guard(match: Match, index: GraphIndex) -> bool:
    q, k, cos, sin, features, _ = match.args
    if not index.is_float32_cpu(q, k, cos, sin):
        return False
    for x, r in zip((q, k), match.results):
        if r is None:
            continue
        xm, rm = index.meta(x), index.graph.values[r].meta
        if len(xm.shape) > 4 or rm.shape != xm.shape:
            return False
        # the layout the op gives: x's own (dense x), or contiguous with features passed through
        if features != -1 and not is_contiguous(rm):
            return False
        # eager's result is dense: when it has x's strides, x is dense and empty_like keeps them
        if features == -1 and rm.stride not in (xm.stride, _empty_like_stride(xm)):
            return False
    return all(index.meta(t).stride[-1] == 1 or index.meta(t).shape[-1] == 1 for t in (cos, sin))


def _empty_like_stride(meta: Any) -> tuple[int, ...] | None:
    """The strides ``empty_like`` gives a tensor of ``meta``'s geometry (the layout of the
    fused op's result), asked of ATen itself on the meta device; None for symbolic sizes."""
    if not meta.is_static:
        return None
    fake = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
    return tuple(torch.empty_like(fake).stride())


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
    return index.is_float32_cpu(gate, up) and is_contiguous(
        index.graph.values[match.results[0]].meta
    )


# --- grouped-query attention --------------------------------------------------------------------


def _unrepeated(index: GraphIndex, x: Any, heads: int) -> tuple[Any, list[Node]] | None:
    """``x`` = K/V heads repeated ``n`` times each (``repeat_kv``): the un-repeated value."""
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
    unsq = index.only_for(expand.args[0], "aten::unsqueeze", _SLICE)
    if unsq is None:
        return None
    base = unsq.args[0]
    bm, em = index.meta(base), index.meta(Ref(expand.outputs[0]))
    if bm is None or em is None or len(bm.shape) != 4 or len(em.shape) != 5:
        return None
    if unsq.op.name == "aten::unsqueeze" and unsq.args[1] not in (2, -3):
        return None
    if unsq.op.name == _SLICE:  # x[:, :, None] traces as slice + unsqueeze in some versions
        return None
    b, hk, n, s, d = em.shape
    if (b, hk, s, d) != tuple(bm.shape) or hk * n != heads:
        return None
    return base, [*chain, expand, unsq]


def match_gqa(node: Node, index: GraphIndex) -> Match | None:
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


def _gqa_guard(match: Match, index: GraphIndex) -> bool:
    return index.is_float32_cpu(*match.args[:3])


# --- registration -------------------------------------------------------------------------------

BUILTIN = ("add_rms_norm", "rms_norm", "rotary", "gated_mlp", "gqa_attention")


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
        {"cpu": Target(_own("rotary"), _rotary_guard), "npu": npu.rotary},
        anchors=[_ADD], doc="rotary embedding of q and k", _builtin=True,
    )  # fmt: skip
    register_pattern(
        "gated_mlp", match_gated,
        {"cpu": Target(_own("gated"), _gated_guard), "npu": npu.gated},
        anchors=[_MUL], doc="act(gate) * up (SiLU, GELU-tanh)", _builtin=True,
    )  # fmt: skip
    register_pattern(
        "gqa_attention", match_gqa,
        {"cpu": Target(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                       _gqa_guard)},
        anchors=[_ATTENTION], doc="attention over un-repeated K/V heads",
        _builtin=True,
    )  # fmt: skip


__all__ = ["BUILTIN", "register_builtins"]
