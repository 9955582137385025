"""LayerNorm written out in ATen ops, as Cohere's ``CohereLayerNorm`` and ConvNeXt-style blocks
write it:

.. code-block:: python

    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)       # or (x - u) * (x - u)
    y = (x - u) * torch.rsqrt(s + eps)              # or / torch.sqrt(s + eps), or eps outside
    y = weight * y + bias                           # each optional, either side

``x - u`` may be one node or two equal ones; in bfloat16 the chain runs on ``x.float()`` and
``weight.float()`` (``bias.float()``) and the result is cast back. The fused op,
``fxrt::layer_norm_chain``, computes the chain as eager does, bit for bit (its two means sum in
ATen's own order). Not matched: the spellings through ``x.var(...)``, and norms over another
dimension than the last.

This pattern runs before ``rms_norm``: with one ``x - u`` node, ``d * rsqrt(mean(d^2) + eps)``
is also an RMS norm of ``d``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ir.graph import Node, Ref, is_contiguous
from .match import CAST, WIDENED, GraphIndex, denominator, inverse_root, row_mean
from .registry import Match

_MUL = "aten::mul.Tensor"
_DIV = "aten::div.Tensor"
_ADD = "aten::add.Tensor"
_SUB = "aten::sub.Tensor"
ANCHORS = (_MUL, _DIV, _ADD, CAST)


def _centered(index: GraphIndex, d: Any) -> tuple[Ref, list[Node]] | None:
    """``d = x - mean(x, -1, keepdim)``: ``(x, [sub, mean])``."""
    sub = index.made_by(d, _SUB)
    if sub is None or len(sub.args) != 2 or sub.kwargs.get("alpha", 1) != 1:
        return None
    x, m = sub.args
    mean = row_mean(index, m)
    if mean is None or mean.args[0] != x or not isinstance(x, Ref):
        return None
    return x, [sub, mean]


def _variance(index: GraphIndex, v: Any) -> tuple[Any, list[Node]] | None:
    """``v = mean(d^2, -1, keepdim)`` (``pow(d, 2)`` or ``d * d``): ``(d, [mean, square])``."""
    mean = row_mean(index, v)
    if mean is None:
        return None
    sq = index.made_by(mean.args[0], "aten::pow.Tensor_Scalar", _MUL)
    if sq is None:
        return None
    d = sq.args[0]
    if sq.op.name == _MUL and sq.args[1] != d:
        return None
    if sq.op.name != _MUL and index.number(sq.args[1]) != 2.0:
        return None
    return d, [mean, sq]


def _core(index: GraphIndex, node: Node) -> tuple[Ref, float, str, list[Node]] | None:
    """``node`` = ``d * inverse_root(v)`` or ``d / denominator(v)`` with ``v`` the variance of
    ``d``: ``(x, eps, root, nodes)``, ``root`` the spelling's name for fxrt::layer_norm_chain."""
    divide = node.op.name == _DIV
    if not divide and node.op.name != _MUL:
        return None
    pairs = [tuple(node.args[:2])] if divide else list(index.operands(node))
    for d2, r in pairs:
        found = denominator(index, r) if divide else inverse_root(index, r)
        if found is None:
            continue
        v, eps, outside, root_nodes = found
        var = _variance(index, v)
        c2 = _centered(index, d2)
        if var is None or c2 is None:
            continue
        c1 = _centered(index, var[0])
        if c1 is None or c1[0] != c2[0]:
            continue
        nodes = list({id(n): n for n in [node, *root_nodes, *var[1], *c1[1], *c2[1]]}.values())
        if _closed(index, nodes, node):
            return c2[0], eps, _root_name(root_nodes[0], divide, outside), nodes
    return None


def _root_name(first: Node, divide: bool, outside: bool) -> str:
    """The op's name for the root's spelling (``first``: the root's last op)."""
    if first.op.name == "aten::rsqrt":
        return "rsqrt"
    name = "sqrt_eps" if outside else "sqrt"
    return name if divide else name + "_reciprocal"


def _closed(index: GraphIndex, nodes: list[Node], last: Node) -> bool:
    """Every value ``nodes`` make, but ``last``'s, is read by them alone (and not returned)."""
    reads: dict[int, int] = {}
    for n in nodes:
        for v in n.input_ids():
            reads[v] = reads.get(v, 0) + 1
    for n in nodes:
        if n is last:
            continue
        for v in n.outputs:
            if v in index.returned or index.uses[v] != reads.get(v, 0):
                return False
    return True


def _row_operand(index: GraphIndex, node: Node) -> tuple[Any, Any] | None:
    """``node`` = ``y op r`` or ``r op y`` (alpha 1) with ``r`` 1-D of y's last dimension's
    size: ``(y, r)``."""
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    for y, r in index.operands(node):
        ym, rm = index.meta(y), index.meta(r)
        if ym is None or rm is None or len(rm.shape) != 1 or len(ym.shape) < 2:
            continue
        if rm.shape[0] == ym.shape[-1] and isinstance(y, Ref):
            return y, r
    return None


def _source(index: GraphIndex, t: Any, dtype: torch.dtype) -> tuple[Any, Node] | None:
    """``t`` = ``s.float()`` with ``s`` of ``dtype``: ``(s, the cast)``."""
    up = index.cast(t, (torch.float32,), only=False)
    if up is None or index.meta(up.args[0]).dtype != dtype:
        return None
    return up.args[0], up


def match_layer_norm(node: Node, index: GraphIndex) -> Match | None:
    found = _chain(index, node)
    if found is None or _extends(index, node):
        return None
    return found


def _chain(index: GraphIndex, node: Node) -> Match | None:
    nodes: list[Node] = []
    cur: Node | None = node
    back = None
    if node.op.name == CAST:
        back = index.cast(Ref(node.outputs[0]), WIDENED, only=False)
        if back is None:
            return None
        nodes.append(back)
        cur = index.only_for(back.args[0], _MUL, _DIV, _ADD)
    bias = weight = None
    if cur is not None and cur.op.name == _ADD:
        found = _row_operand(index, cur)
        if found is None:
            return None
        nodes.append(cur)
        bias = found[1]
        cur = index.only_for(found[0], _MUL, _DIV)
    if cur is None:
        return None
    core = _core(index, cur)
    if core is None and cur.op.name == _MUL:
        found = _row_operand(index, cur)
        if found is None:
            return None
        nodes.append(cur)
        weight = found[1]
        inner = index.only_for(found[0], _MUL, _DIV)
        core = None if inner is None else _core(index, inner)
    if core is None:
        return None
    x, eps, root, core_nodes = core
    nodes.extend(core_nodes)
    widened = back is not None
    if widened:  # the chain on x.float() (and weight.float(), bias.float()), cast back
        dtype = index.meta(Ref(node.outputs[0])).dtype
        sources = [_source(index, t, dtype) for t in (x, weight, bias) if t is not None]
        if any(s is None for s in sources):
            return None  # a float32 chain: the cast back is not the norm's
        ups = iter(sources)
        x, weight, bias = (None if t is None else next(ups)[0] for t in (x, weight, bias))
        nodes.extend(up for _, up in sources)
    return Match(
        (x, weight, bias, eps, root), {}, [node.outputs[0]], nodes,
        info={"widened": widened},
    )  # fmt: skip


def _extends(index: GraphIndex, node: Node) -> bool:
    """The one reader of ``node``'s result continues the chain (the weight's product, the
    bias's sum, the cast back): that reader is the anchor."""
    v = node.outputs[0]
    if index.uses[v] != 1 or v in index.returned:
        return False
    reader = index.readers[v][0]
    return reader.op.name in ANCHORS and _chain(index, reader) is not None


def layer_norm_guard(match: Match, index: GraphIndex) -> bool:
    x, weight, bias = match.args[:3]
    meta, out = index.meta(x), index.graph.values[match.results[0]].meta
    rows = [t for t in (weight, bias) if t is not None]
    return (
        index.is_float_cpu(x, Ref(match.results[0]), *rows)
        and meta is not None
        and (meta.dtype is torch.float32 or match.info["widened"])
        and is_contiguous(meta)
        and is_contiguous(out)
    )


__all__ = ["ANCHORS", "layer_norm_guard", "match_layer_norm"]
