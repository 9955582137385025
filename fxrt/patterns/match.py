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


__all__ = ["CAST", "WIDENED", "GraphIndex", "is_contiguous", "last_dim"]
