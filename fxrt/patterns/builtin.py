"""The built-in patterns of a decoder block, registered when :mod:`fxrt.patterns` is imported.

Each matcher accepts the math, in the spellings models trace to (checked on Llama, Qwen2, Qwen3,
Mistral, Gemma, Phi-3 and Cohere from ``transformers``, and on hand-written blocks in the tests):

``layer_norm``
    LayerNorm written out: ``(x - u) * rsqrt(mean((x - u)^2) + eps)`` with ``u`` x's mean over
    the last dimension, the root's spellings as the RMS norms', then optionally a weight and a
    bias (1-D); in bfloat16 on ``x.float()`` and cast back (:mod:`fxrt.patterns.layer_norm`).

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
    :mod:`fxrt.patterns.attention`), whose only target is the NPU's.
``gqa_softcap_attention``
    the same over soft-capped attention (``fxrt::softcap_sdpa``, what
    :mod:`fxrt.passes.fuse_attention` makes of Gemma-2's ``softcap * tanh(scores / softcap)``
    written out); CPU only (no NPU target: ``torch_npu``'s attention has no soft cap).

Targets: on the CPU fxrt's own ops (``fxrt::layer_norm_chain``, ``fxrt::rms_norm``,
``fxrt::add_rms_norm``, ``fxrt::rotary``, ``fxrt::rotary_complex``, ``fxrt::gated``; the
attention op itself for the two attention patterns), for float32 and bfloat16 tensors with the
layouts their fast paths read; on Ascend NPUs
``torch_npu``'s fused ops (:mod:`fxrt.patterns.npu`), looked up only when a graph's tensors are
on an NPU.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ir.graph import Node, Ref, dense_rows
from . import npu
from .attention import ATTENTION, SOFTCAP_ATTENTION, gqa_guard, match_gqa
from .layer_norm import ANCHORS as LAYER_NORM_ANCHORS
from .layer_norm import layer_norm_guard, match_layer_norm
from .match import (
    CAST,
    WIDENED,
    GraphIndex,
    denominator,
    inverse_root,
    is_contiguous,
    plus_number,
    row_mean,
)
from .registry import Match, Target, register_pattern
from .rotary import match_rotary, rotary_guard
from .rotary_complex import match_rotary_complex, rotary_complex_guard

_MUL = "aten::mul.Tensor"
_ADD = "aten::add.Tensor"
_SLICE = "aten::slice.Tensor"
_RESHAPES = ("aten::view", "aten::_unsafe_view", "aten::reshape")


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
            found = denominator(index, r)
        else:
            found = inverse_root(index, r)
        if found is None:
            continue
        ms, eps, outside, chain = found
        if _mean_square_of(index, ms, x, chain):
            return x, eps, outside, [node, *chain]
    return None


def _mean_square_of(index: GraphIndex, ms: Any, x: Any, chain: list[Node]) -> bool:
    mean = row_mean(index, ms, only=True)
    if mean is None or not isinstance(x, Ref):
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
        offset = plus_number(index, plus) if plus is not None else None
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
    """Float CPU rows, and a result laid out as ``fxrt::rms_norm`` lays its out: contiguous,
    or (rows dense in memory, as Gemma-3's per-head norms after their transpose) x's strides."""
    x, weight, _, offset = match.args[:4]
    meta = index.meta(x)
    out = index.graph.values[match.results[0]].meta
    return (
        index.is_float_cpu(x, Ref(match.results[0]), *([] if weight is None else [weight]))
        and (meta.dtype is torch.float32 or (match.info["widened"] and offset == 0.0))
        and dense_rows(meta)
        and (is_contiguous(out) if is_contiguous(meta) else out.stride == meta.stride)
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


# --- registration -------------------------------------------------------------------------------

BUILTIN = (
    "layer_norm", "add_rms_norm", "rms_norm", "rotary", "rotary_complex", "gated_mlp",
    "gqa_attention", "gqa_softcap_attention",
)  # fmt: skip


def register_builtins() -> None:
    # before the RMS norms: a written-out LayerNorm's d * rsqrt(mean(d^2) + eps) is one of d
    register_pattern(
        "layer_norm", match_layer_norm,
        {"cpu": Target(_own("layer_norm_chain"), layer_norm_guard), "npu": npu.layer_norm},
        anchors=list(LAYER_NORM_ANCHORS), doc="LayerNorm written out", _builtin=True,
    )  # fmt: skip
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
                       gqa_guard), "npu": npu.attention},
        anchors=[ATTENTION, "aten::view"], doc="attention over un-repeated K/V heads",
        _builtin=True,
    )  # fmt: skip
    register_pattern(
        "gqa_softcap_attention", match_gqa,
        {"cpu": Target(_own("softcap_sdpa"), gqa_guard)},
        anchors=[SOFTCAP_ATTENTION], doc="soft-capped attention over un-repeated K/V heads",
        _builtin=True,
    )  # fmt: skip


__all__ = ["BUILTIN", "register_builtins"]
