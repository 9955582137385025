"""Hypothesis strategies for random, valid ATen-level FX graphs.

A graph is built node by node with ``torch.fx.Graph``: each candidate op is first run on real
tensors standing in for the values so far, and kept only if eager PyTorch accepts it (so shapes,
broadcasting, in-place restrictions and view rules are always valid). The real result becomes the
node's ``meta["val"]``. Test inputs are regenerated from a seed, so nothing of the generation run
leaks into the test.

The vocabulary covers elementwise unary and broadcasting binary ops, reductions with keepdim,
matmul and linear, chains of views (view, reshape, transpose, permute, slice, select, expand,
unsqueeze, t, split), in-place ops on intermediates, views and inputs, multi-output ops read
through getitem, constants, dead code, duplicated outputs and outputs that are inputs or views of
them, and an int input used as a dynamic size (with ``sym_size`` and Python arithmetic on sizes).
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from hypothesis import strategies as st

aten = torch.ops.aten

UNARY = [
    aten.relu.default,
    aten.sin.default,
    aten.neg.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.abs.default,
    aten.exp.default,
]
BINARY = [aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.maximum.default]
INPLACE = [aten.add_.Tensor, aten.mul_.Tensor, aten.relu_.default, aten.sin_.default]
KINDS = [
    "unary",
    "binary",
    "scalar",
    "reduce",
    "matmul",
    "linear",
    "view",
    "reshape",
    "transpose",
    "permute",
    "slice",
    "select",
    "expand",
    "unsqueeze",
    "t",
    "split",
    "inplace",
    "multi",
    "clone",
    "symview",
]


@dataclass
class GeneratedGraph:
    module: torch.fx.GraphModule
    shapes: list[Any]  # per input: a shape tuple for tensors, or an int
    seed: int

    @property
    def gm(self) -> torch.fx.GraphModule:
        """A fresh copy each time: a graph may write its constants in place, and every run
        (eager or compiled) must start from the same state."""
        return copy.deepcopy(self.module)

    def inputs(self) -> list[Any]:
        gen = torch.Generator().manual_seed(self.seed)
        return [torch.randn(s, generator=gen) if isinstance(s, tuple) else s for s in self.shapes]

    def __repr__(self) -> str:  # what hypothesis prints for a failing (shrunk) example
        return f"GeneratedGraph(shapes={self.shapes}, seed={self.seed}):\n{self.module.code}"


class _Builder:
    def __init__(self, draw):
        self.draw = draw
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()
        self.pool: list[tuple[torch.fx.Node, Any]] = []  # (node, value) of every usable value

    def tensors(self) -> list[int]:
        return [i for i, (_, v) in enumerate(self.pool) if isinstance(v, torch.Tensor)]

    def pick_tensor(self) -> tuple[torch.fx.Node, torch.Tensor]:
        idx = self.tensors()
        if self.draw(st.booleans()):  # the newest value: builds chains, views of views
            return self.pool[idx[-1]]
        return self.pool[self.draw(st.sampled_from(idx))]

    def emit(self, target: Any, args: tuple, vals: tuple, kwargs: dict | None = None) -> Any:
        """Run ``target`` eagerly on ``vals``; on success add the node and return its value."""
        kwargs = kwargs or {}
        try:
            result = target(*vals, **kwargs)
        except Exception:
            return None
        node = self.graph.call_function(target, args, kwargs)
        node.meta["val"] = result
        if isinstance(result, (tuple, list)):
            for i in sorted(
                set(
                    self.draw(
                        st.lists(st.integers(0, len(result) - 1), min_size=1, max_size=len(result))
                    )
                )
            ):
                item = self.graph.call_function(operator.getitem, (node, i))
                item.meta["val"] = result[i]
                self.pool.append((item, result[i]))
        else:
            self.pool.append((node, result))
        return result

    def dim(self, t: torch.Tensor) -> int:
        return self.draw(st.integers(0, max(t.dim() - 1, 0)))

    def step(self, kind: str) -> None:
        d = self.draw
        node, t = self.pick_tensor()
        if kind == "unary":
            self.emit(d(st.sampled_from(UNARY)), (node,), (t,))
        elif kind == "binary":
            node2, t2 = self.pick_tensor()
            op = d(st.sampled_from(BINARY))
            self.emit(op, (node, node2), (t, t2))
        elif kind == "scalar":
            c = d(st.sampled_from([0.5, 2.0, -1.0]))
            self.emit(d(st.sampled_from([aten.add.Tensor, aten.mul.Tensor])), (node, c), (t, c))
        elif kind == "reduce":
            op = d(st.sampled_from([aten.sum.dim_IntList, aten.mean.dim, aten.amax.default]))
            dims, keep = [self.dim(t)], d(st.booleans())
            self.emit(op, (node, dims, keep), (t, dims, keep))
        elif kind == "matmul":
            node2, t2 = self.pick_tensor()
            self.emit(aten.mm.default, (node, node2), (t, t2))
        elif kind == "linear":
            (wnode, w), (bnode, b) = self.pick_tensor(), self.pick_tensor()
            if d(st.booleans()):
                self.emit(aten.linear.default, (node, wnode, bnode), (t, w, b))
            else:
                self.emit(aten.linear.default, (node, wnode), (t, w))
        elif kind == "view":
            self.emit(aten.view.default, (node, [-1]), (t, [-1]))
        elif kind == "reshape":
            shape = [t.shape[0], -1] if t.dim() else [1]
            self.emit(aten.reshape.default, (node, shape), (t, shape))
        elif kind == "transpose":
            a, b = self.dim(t), self.dim(t)
            self.emit(aten.transpose.int, (node, a, b), (t, a, b))
        elif kind == "permute":
            perm = d(st.permutations(range(t.dim())))
            self.emit(aten.permute.default, (node, perm), (t, perm))
        elif kind == "slice":
            dim = self.dim(t)
            start, step = d(st.integers(0, 2)), d(st.integers(1, 2))
            self.emit(
                aten.slice.Tensor, (node, dim, start, None, step), (t, dim, start, None, step)
            )
        elif kind == "select" and t.dim() > 0:
            dim = self.dim(t)
            idx = d(st.integers(-t.shape[dim], max(t.shape[dim] - 1, 0)))
            self.emit(aten.select.int, (node, dim, idx), (t, dim, idx))
        elif kind == "expand":
            shape = [d(st.integers(1, 3))] + list(t.shape)
            self.emit(aten.expand.default, (node, shape), (t, shape))
        elif kind == "unsqueeze":
            dim = d(st.integers(0, t.dim()))
            self.emit(aten.unsqueeze.default, (node, dim), (t, dim))
        elif kind == "t" and t.dim() <= 2:
            self.emit(aten.t.default, (node,), (t,))
        elif kind == "split":
            size, dim = d(st.integers(1, 3)), self.dim(t)
            self.emit(aten.split.Tensor, (node, size, dim), (t, size, dim))
        elif kind == "inplace":
            op = d(st.sampled_from(INPLACE))
            if op in (aten.add_.Tensor, aten.mul_.Tensor):
                node2, t2 = self.pick_tensor()
                self.emit(op, (node, node2), (t, t2))
            else:
                self.emit(op, (node,), (t,))
        elif kind == "multi":
            dim = self.dim(t)
            op = d(st.sampled_from(["max", "var_mean"]))
            if op == "max":
                self.emit(aten.max.dim, (node, dim), (t, dim))
            else:
                self.emit(aten.var_mean.correction, (node, [dim]), (t, [dim]), {"correction": 0})
        elif kind == "clone":
            self.emit(aten.clone.default, (node,), (t,))
        elif kind == "symview" and t.dim() > 0:
            # A size read at run time: sym_size.int, Python arithmetic on it (a fallback), and an
            # int-list argument that mixes a register with constants.
            dim = self.dim(t)
            size = self.graph.call_function(aten.sym_size.int, (node, dim))
            size.meta["val"] = t.shape[dim]
            same = self.graph.call_function(operator.mul, (size, 1))
            same.meta["val"] = t.shape[dim]
            if self.emit(aten.movedim.int, (node, dim, 0), (t, dim, 0)) is None:
                return
            mnode, mval = self.pool[-1]
            fmt = {"memory_format": torch.contiguous_format}
            if self.emit(aten.clone.default, (mnode,), (mval,), fmt) is None:
                return
            cnode, cval = self.pool[-1]
            self.emit(aten.view.default, (cnode, [same, -1]), (cval, [t.shape[dim], -1]))


@st.composite
def generated_graphs(draw, max_ops: int = 12) -> GeneratedGraph:
    b = _Builder(draw)
    dims = st.integers(1, 4)
    shapes: list[Any] = []
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(dims, min_size=1, max_size=3)))
        node = b.graph.placeholder(f"x{i}")
        val = torch.randn(shape)
        node.meta["val"] = val
        b.pool.append((node, val))
        shapes.append(shape)
    if draw(st.booleans()):  # an int input, as Dynamo passes a dynamic size
        n = b.pool[0][1].shape[0]
        node = b.graph.placeholder("n")
        node.meta["val"] = n
        shapes.append(n)
        t0 = b.pool[0]
        b.emit(aten.view.default, (t0[0], [node, -1]), (t0[1], [n, -1]))
    if draw(st.booleans()):  # a constant the graph owns
        b.root.register_buffer("const0", torch.linspace(-1, 1, 4))
        node = b.graph.get_attr("const0")
        node.meta["val"] = b.root.const0
        b.pool.append((node, b.root.const0))
    for _ in range(draw(st.integers(0, max_ops))):
        b.step(draw(st.sampled_from(KINDS)))
    picks = draw(st.lists(st.integers(0, len(b.pool) - 1), min_size=1, max_size=4))
    b.graph.output(tuple(b.pool[i][0] for i in picks))
    gm = torch.fx.GraphModule(b.root, b.graph)
    return GeneratedGraph(gm, shapes, draw(st.integers(0, 2**16)))
