"""The built-in ``rotary_complex`` pattern: the rotary embedding written as a complex product
(registered in :mod:`fxrt.patterns.builtin`).

Meta's Llama writes it as ``view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) *
freqs_cis).flatten(3).type_as(x)``; code that avoids complex tensors (gpt-fast) multiplies the
same pairs out by hand on a real ``(cos, sin)`` cache::

    xs = x.float().reshape(..., -1, 2)
    stack([xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1],
           xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]], -1).flatten(3).type_as(x)

Both are one call of ``fxrt::rotary_complex(q, k, freqs)``: :func:`_pairs_chain` reads one
tensor's chain from its ``view_as_real`` or ``stack`` (the anchors) forward to the flattened
result and the cast back, and back to ``x`` (a bfloat16 ``x`` with its cast to float32 is read
as the op's bfloat16 input); :func:`match_rotary_complex` pairs the query's chain with the key's,
the next chain over the same frequencies (each chain may take its own view of one cache, as
Meta's code does).
"""

from __future__ import annotations

from typing import Any

import torch

from ..ir.graph import Node, Ref
from .match import CAST, WIDENED, GraphIndex, is_contiguous
from .registry import Match
from .rotary import pair_place

_MUL = "aten::mul.Tensor"
_RESHAPES = ("aten::view", "aten::_unsafe_view", "aten::reshape")
# ops whose result is a function of their arguments alone: two such nodes with equal arguments
# make equal values (a per-chain view of the frequency cache)
_VIEWS = frozenset(
    {*_RESHAPES, "aten::slice.Tensor", "aten::select.int", "aten::unsqueeze", "aten::alias"}
    | {"aten::expand", "aten::view_as_real", "aten::view_as_complex"}
)


def _pairs_chain(index: GraphIndex, node: Node) -> dict[str, Any] | None:
    """The chain whose product ``node`` (a ``view_as_real`` or a ``stack``) takes apart: the
    source ``x``, the frequencies, the value the caller sees, and the nodes."""
    if node.op.name == "aten::view_as_real":
        found = [_complex_product(index, node)]
    else:
        found = _real_products(index, node)
    flat = _sole_reader(index, node.outputs[0], *_RESHAPES)
    for pairs, freqs, nodes in (f for f in found if f is not None):
        view = index.made_by(pairs, *_RESHAPES)
        if flat is None or view is None:
            continue
        x = view.args[0]
        xm, pm = index.meta(x), index.meta(pairs)
        if xm is None or index.meta(Ref(flat.outputs[0])).shape != xm.shape or len(xm.shape) < 2:
            continue
        if pm.shape[-1] != 2 or tuple(pm.shape[:-2]) != tuple(xm.shape[:-1]):
            continue
        nodes, out = [*nodes, view, flat], flat.outputs[0]
        up = index.cast(x, (torch.float32,), only=False)
        low = index.meta(up.args[0]).dtype if up is not None else None
        back = _sole_reader(index, out, CAST) if low in WIDENED else None
        if back is not None and index.cast(Ref(back.outputs[0]), (low,), only=False) is back:
            x, out, nodes = up.args[0], back.outputs[0], [*nodes, up, back]
        if _only_inside(index, nodes, index.producer[out]):
            return dict(x=x, freqs=freqs, out=out, nodes=nodes)
    return None


def _sole_reader(index: GraphIndex, v: int, *names: str) -> Node | None:
    """The one node that reads value ``v``, when its op is one of ``names`` and the caller does
    not receive ``v``."""
    readers = index.readers.get(v, [])
    if index.uses[v] != 1 or v in index.returned or len(readers) != 1:
        return None
    return readers[0] if readers[0].op.name in names and not readers[0].multi else None


def _complex_product(index: GraphIndex, node: Node) -> tuple[Any, Any, list[Node]] | None:
    """``view_as_real(view_as_complex(pairs) * freqs)``: (pairs, freqs, nodes)."""
    mul = index.only_for(node.args[0], _MUL)
    if mul is None or mul.kwargs:
        return None
    for z, freqs in index.operands(mul):
        vc = index.only_for(z, "aten::view_as_complex")
        fm = index.meta(freqs)
        if vc is not None and fm is not None and fm.dtype == torch.complex64:
            return vc.args[0], freqs, [node, mul, vc]
    return None


def _real_products(index: GraphIndex, node: Node) -> list[tuple[Any, Any, list[Node]]]:
    """``stack([x0 * c - x1 * s, x1 * c + x0 * s], -1)`` over selects of two pair tensors:
    (pairs, freqs, nodes) for each way of telling the two apart (the product is symmetric; the
    caller keeps the one that is a view of the chain's input). Each product, and the sum, in
    either order."""
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else 0
    sub = index.only_for(parts[0], "aten::sub.Tensor") if len(parts) == 2 else None
    add = index.only_for(parts[1], "aten::add.Tensor") if sub is not None else None
    rank = len(index.meta(Ref(node.outputs[0])).shape)
    if add is None or sub.kwargs or add.kwargs or dim not in (-1, rank - 1):
        return []
    terms = [_product(index, t) for t in (*sub.args, *add.args)]
    if any(t is None for t in terms):
        return []
    (ac, n0), (bs, n1), (im0, n2), (im1, n3) = terms  # type: ignore[misc]
    nodes = list({id(n): n for n in (node, sub, add, *n0, *n1, *n2, *n3)}.values())
    found = []
    for x, f in {(ac[0][0], ac[1][0]), (ac[1][0], ac[0][0])}:
        sums = {frozenset({(x, 1), (f, 0)}), frozenset({(x, 0), (f, 1)})}
        want = [{(x, 0), (f, 0)}, {(x, 1), (f, 1)}, sums]
        if x != f and [set(ac), set(bs), {frozenset(im0), frozenset(im1)}] == want:
            found.append((Ref(x), Ref(f), nodes))
    return found


def _product(index: GraphIndex, v: Any) -> tuple[list[tuple[int, int]], list[Node]] | None:
    """``v`` = ``select(a, -1, i) * select(b, -1, j)``: ([(a, i), (b, j)], its nodes)."""
    mul = index.made_by(v, _MUL)
    if mul is None or mul.kwargs:
        return None
    picks = [_select(index, a) for a in mul.args]
    if picks[0] is None or picks[1] is None:
        return None
    return [picks[0][0], picks[1][0]], [mul, picks[0][1], picks[1][1]]


def _select(index: GraphIndex, v: Any) -> tuple[tuple[int, int], Node] | None:
    """``v`` = ``select(src, -1, 0 or 1)`` over a last dimension of 2: ((src's id, 0 or 1),
    the node)."""
    node = index.made_by(v, "aten::select.int")
    if node is None or len(node.args) != 3 or not isinstance(node.args[0], Ref):
        return None
    src = index.meta(node.args[0])
    dim, i = node.args[1], node.args[2]
    if src is None or src.shape[-1] != 2 or dim not in (-1, len(src.shape) - 1):
        return None
    return ((node.args[0].id, i % 2), node) if i in (-2, -1, 0, 1) else None


def _only_inside(index: GraphIndex, nodes: list[Node], last: Node) -> bool:
    """Every value the chain makes before ``last`` is read by the chain alone."""
    inside = {id(n) for n in nodes}
    for n in nodes:
        if n is last:
            continue
        for v in n.outputs:
            if v in index.returned or any(id(r) not in inside for r in index.readers.get(v, ())):
                return False
    return True


def _same_value(index: GraphIndex, a: Any, b: Any, depth: int = 8) -> bool:
    """``a`` and ``b`` are one value, or views made the same way of one value."""
    if a == b:
        return True
    if depth == 0 or not isinstance(a, Ref) or not isinstance(b, Ref):
        return False
    na, nb = index.producer.get(a.id), index.producer.get(b.id)
    if na is None or nb is None or na.op.name != nb.op.name or na.op.name not in _VIEWS:
        return False
    if na.kwargs != nb.kwargs or len(na.args) != len(nb.args):
        return False
    return all(_same_arg(index, x, y, depth - 1) for x, y in zip(na.args, nb.args))


def _same_arg(index: GraphIndex, x: Any, y: Any, depth: int) -> bool:
    if isinstance(x, Ref) or isinstance(y, Ref):
        return _same_value(index, x, y, depth)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same_arg(index, p, q, depth) for p, q in zip(x, y))
    return type(x) is type(y) and x == y


def match_rotary_complex(node: Node, index: GraphIndex) -> Match | None:
    first = _pairs_chain(index, node)
    if first is None:
        return None
    second = None
    dtype = index.meta(first["x"]).dtype
    for cand in index.graph.nodes[index.position[id(node)] + 1 :]:
        if cand.op.name not in ("aten::view_as_real", "aten::stack") or id(cand) in index.claimed:
            continue
        other = _pairs_chain(index, cand)
        if (
            other is not None
            and other["x"] != first["x"]
            and index.meta(other["x"]).dtype == dtype
            and _same_value(index, other["freqs"], first["freqs"])
        ):
            second = other
            break
    fits, at = pair_place(index, first, second) if second is not None else (False, None)
    if not fits:
        args = (first["x"], first["x"], first["freqs"])
        return Match(args, {}, [first["out"], None], first["nodes"])
    args = (first["x"], second["x"], first["freqs"])
    return Match(args, {}, [first["out"], second["out"]], first["nodes"] + second["nodes"], at=at)


def rotary_complex_guard(match: Match, index: GraphIndex) -> bool:
    """fxrt::rotary_complex's fast path: float32 or bfloat16 CPU q and k (at most 4-D, features
    in adjacent pairs), float32 (cos, sin) pairs side by side, contiguous results."""
    q, k, freqs = match.args
    if not index.is_float_cpu(q, k):
        return False
    fm = index.meta(freqs)
    if fm is None or fm.device != "cpu":
        return False
    if fm.dtype == torch.complex64:
        pair_ok = fm.stride[-1] == 1 or fm.shape[-1] == 1
    else:
        pair_ok = fm.dtype == torch.float32 and fm.shape[-1] == 2 and fm.stride[-1] == 1
        pair_ok = pair_ok and (fm.stride[-2] == 2 or fm.shape[-2] == 1)
    if not pair_ok:
        return False
    for x, r in zip((q, k), match.results):
        xm = index.meta(x)
        if len(xm.shape) > 4 or xm.stride[-1] != 1:
            return False
        if r is not None and not is_contiguous(index.graph.values[r].meta):
            return False
    return True


__all__ = ["match_rotary_complex", "rotary_complex_guard"]
