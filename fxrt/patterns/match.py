"""What a pattern's matcher reads of the graph: who makes a value, who reads it, and small
predicates that let one matcher accept the spellings real models trace to.

A matcher walks from an anchor node (the last op of the chain) back through the producers of its
arguments. :class:`GraphIndex` answers the questions it asks at every step:

* :meth:`GraphIndex.made_by`: the node that makes a value, if it is one of the named ops;
* :meth:`GraphIndex.only_for`: the same, when nothing but the chain reads that value (an
  intermediate the fused op may drop; a value the caller or another op reads keeps its op);
* :meth:`GraphIndex.operands`: the two arguments of a commutative op in both orders, so
  ``w * y`` and ``y * w`` are one case;
* :meth:`GraphIndex.number`: a Python number argument (``eps``, a scale);
* :meth:`GraphIndex.cast`: the plain dtype cast that makes a value (the casts models write
  around a chain they widen to float32).

The index is built once per scan of the graph and is read-only; the stage rebuilds it after a
rewrite (:mod:`fxrt.patterns.fuse`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from ..ir.graph import Graph, Node, Ref, TensorMeta, is_contiguous
from .registry import Made, View

CAST = "aten::_to_copy"
WIDENED = (torch.bfloat16,)  # dtypes models widen to float32 around a chain, and cast back to


class GraphIndex:
    """Producers, readers and read counts of every value of ``graph``."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.producer: dict[int, Node] = {}
        self.readers: dict[int, list[Node]] = {}
        self.position: dict[int, int] = {}  # id(node) -> its index in graph.nodes
        self.uses = Counter(graph.output_ids())  # reads; the caller's count too
        self.returned = frozenset(graph.output_ids())
        self.claimed: set[int] = set()  # id() of nodes an earlier match of this scan took
        for i, n in enumerate(graph.nodes):
            self.position[id(n)] = i
            for v in n.outputs:
                self.producer[v] = n
            ins = n.input_ids()
            self.uses.update(ins)
            for v in dict.fromkeys(ins):
                self.readers.setdefault(v, []).append(n)

    def meta(self, x: Any) -> TensorMeta | None:
        """The tensor metadata of a :class:`Ref`, a :class:`~fxrt.patterns.View` or a
        :class:`~fxrt.patterns.Made` given its meta (None for anything else)."""
        if isinstance(x, (View, Made)):
            return x.meta
        return self.graph.values[x.id].meta if isinstance(x, Ref) else None

    def made_by(self, x: Any, *names: str) -> Node | None:
        """The node that makes ``x`` (a Ref) when its op is one of ``names``; a node with several
        results never (a pattern reads single results)."""
        if not isinstance(x, Ref):
            return None
        n = self.producer.get(x.id)
        return n if n is not None and n.op.name in names and not n.multi else None

    def only_for(self, x: Any, *names: str, reads: int = 1) -> Node | None:
        """:meth:`made_by`, when ``x`` is read exactly ``reads`` times in all and the caller never
        receives it: an intermediate of the chain being matched."""
        if not isinstance(x, Ref) or self.uses[x.id] != reads or x.id in self.returned:
            return None
        return self.made_by(x, *names)

    def cast(self, x: Any, to: tuple[Any, ...], only: bool = True) -> Node | None:
        """The node that makes ``x`` as a plain dtype cast (same device) to one of ``to``, read
        only by the chain when ``only``."""
        node = (self.only_for if only else self.made_by)(x, CAST)
        if node is None or set(node.kwargs) - {"dtype", "device", "layout"} or len(node.args) != 1:
            return None
        meta, src = self.meta(x), self.meta(node.args[0])
        if meta is None or src is None or meta.device != src.device or meta.dtype not in to:
            return None
        return node

    def operands(self, node: Node) -> Iterator[tuple[Any, Any]]:
        """``(a, b)`` and ``(b, a)`` for a commutative binary op's two arguments."""
        a, b = node.args[0], node.args[1]
        yield a, b
        yield b, a

    @staticmethod
    def number(x: Any) -> float | None:
        """``x`` as a float when it is a Python number (not a bool), else None."""
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return None
        return float(x)

    def is_float32_cpu(self, *xs: Any) -> bool:
        """Every one of ``xs`` is a float32 CPU tensor value."""
        for x in xs:
            m = self.meta(x)
            if m is None or m.dtype != torch.float32 or m.device != "cpu":
                return False
        return True

    def is_float_cpu(self, *xs: Any) -> bool:
        """Every one of ``xs`` is a CPU tensor value of one dtype, float32 or bfloat16 (what
        fxrt's own decoder ops compute fast)."""
        dtypes = set()
        for x in xs:
            m = self.meta(x)
            if m is None or m.device != "cpu":
                return False
            dtypes.add(m.dtype)
        return len(dtypes) == 1 and dtypes <= {torch.float32, torch.bfloat16}

    def before(self, a: Node, b: Node) -> bool:
        return self.position[id(a)] < self.position[id(b)]


def last_dim(meta: TensorMeta, dims: Any) -> bool:
    """``dims`` (a reduction's ``dim`` argument) names exactly the last dimension of ``meta``."""
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or type(dims[0]) is not int:
        return False
    return dims[0] in (-1, len(meta.shape) - 1)


def row_mean(index: GraphIndex, v: Any, only: bool = False) -> Node | None:
    """The node that makes ``v`` as ``mean(t, [-1], keepdim=True)`` without a dtype (read by the
    chain alone when ``only``)."""
    mean = (index.only_for if only else index.made_by)(v, "aten::mean.dim")
    if mean is None:
        return None
    meta = index.meta(mean.args[0])
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if meta is None or not last_dim(meta, mean.args[1]) or keepdim is not True:
        return None
    return None if mean.kwargs.get("dtype") is not None else mean


# --- the pieces of a norm: its root and its eps -------------------------------------------------

_ADD = "aten::add.Tensor"


def inverse_root(index: GraphIndex, r: Any) -> tuple[Any, float, bool, list[Node]] | None:
    """``r`` = ``rsqrt(v + eps)`` or ``reciprocal(denominator)``, each step read by the chain
    alone: ``(v, eps, eps_outside, nodes)``."""
    rs = index.only_for(r, "aten::rsqrt")
    if rs is not None:
        add = index.only_for(rs.args[0], _ADD)
        eps = plus_number(index, add)
        if eps is not None:
            return add.args[0], eps, False, [rs, add]
        return None
    rec = index.only_for(r, "aten::reciprocal")
    if rec is not None:  # 1 / (sqrt(ms) + eps)
        found = denominator(index, rec.args[0])
        return None if found is None else (*found[:3], [rec, *found[3]])
    return None


def denominator(index: GraphIndex, d: Any) -> tuple[Any, float, bool, list[Node]] | None:
    """``d`` = ``sqrt(v + eps)`` or ``sqrt(v) + eps``: ``(v, eps, eps_outside, nodes)``."""
    sq = index.only_for(d, "aten::sqrt")
    if sq is not None:
        add = index.only_for(sq.args[0], _ADD)
        eps = plus_number(index, add)
        return None if eps is None else (add.args[0], eps, False, [sq, add])
    add = index.only_for(d, _ADD)
    eps = plus_number(index, add)
    if eps is None:
        return None
    sq = index.only_for(add.args[0], "aten::sqrt")
    return None if sq is None else (sq.args[0], eps, True, [add, sq])


def plus_number(index: GraphIndex, add: Node | None) -> float | None:
    """``add`` = ``value + eps`` (alpha 1) with ``eps`` a finite number >= 0: ``eps``."""
    if add is None or len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    eps = index.number(add.args[1])
    return eps if eps is not None and math.isfinite(eps) and eps >= 0 else None


__all__ = [
    "CAST", "WIDENED", "GraphIndex", "denominator", "inverse_root", "is_contiguous", "last_dim",
    "plus_number", "row_mean",
]  # fmt: skip
