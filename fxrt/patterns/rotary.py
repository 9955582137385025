"""The built-in ``rotary`` pattern's matcher and CPU guard (registered in
:mod:`fxrt.patterns.builtin`, which says what it matches).

A chain is ``x * cos + rotate(x) * sin`` (:func:`_rope_chain`), with ``rotate`` one of the two
rotations (:func:`_rotated`); a partial rotation's ``cat`` with the features passed through is
part of the chain (:func:`_rope_one`). :func:`match_rotary` pairs the query's chain with the
key's, the next chain over the same ``cos`` and ``sin``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ir.graph import Node, Ref
from .match import GraphIndex, is_contiguous
from .registry import Match

_MUL = "aten::mul.Tensor"
_ADD = "aten::add.Tensor"
_SLICE = "aten::slice.Tensor"
_RESHAPES = ("aten::view", "aten::_unsafe_view", "aten::reshape")


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
    fits, at = pair_place(index, first, second) if second is not None else (False, None)
    if not fits:
        args = (first["x"], first["x"], first["cos"], first["sin"], features, first["inter"])
        return Match(args, {}, [first["out"], None], first["nodes"])
    args = (first["x"], second["x"], first["cos"], first["sin"], features, first["inter"])
    nodes = first["nodes"] + second["nodes"]
    return Match(args, {}, [first["out"], second["out"]], nodes, at=at)


def pair_place(
    index: GraphIndex, first: dict[str, Any], second: dict[str, Any]
) -> tuple[bool, Node | None]:
    """Whether one call can stand for q's chain ``first`` and k's ``second`` (each with ``x``,
    ``out`` and ``nodes``), and the node it goes after: q's chain's last when k is made by then
    (a reader of q's result may come before k's chain ends, as Phi-3's cat does), else None, the
    end of k's chain, which no reader of q's result may precede (else each chain is its own
    call). The pass checks the place either way."""
    q_end = max(first["nodes"], key=lambda n: index.position[id(n)])
    k_made = index.producer.get(second["x"].id) if isinstance(second["x"], Ref) else None
    if k_made is None or index.before(k_made, q_end):
        return True, q_end
    k_end = max(second["nodes"], key=lambda n: index.position[id(n)])
    return not any(index.before(r, k_end) for r in index.readers.get(first["out"], ())), None


def rotary_guard(match: Match, index: GraphIndex) -> bool:
    q, k, cos, sin, features, _ = match.args
    if not index.is_float_cpu(q, k, cos, sin):
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


__all__ = ["match_rotary", "pair_place", "rotary_guard"]
