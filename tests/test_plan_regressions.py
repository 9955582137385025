"""Regression tests for planner and pass bugs the property tests found, one per bug."""

from __future__ import annotations

import torch
from conftest import native_available
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.exec.memory import measure_live_bytes
from fxrt.exec.plan import bind_sizes

aten = torch.ops.aten
LOOPS = ["python", "cpp"] if native_available() else ["python"]


def check(fn, inputs, **config):
    """Both loops equal eager; predicted live bytes equal the measured ones."""
    gm = fn if isinstance(fn, torch.fx.GraphModule) else make_fx(fn)(*inputs)
    want = gm(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    for loop in LOOPS:
        cfg = fxrt.CompilerConfig(pure_python=loop == "python", cache=False, **config)
        cg = fxrt.compile_graph(gm, inputs, cfg)
        got = cg(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
        torch.testing.assert_close(got, want)
    plan = cg.plan
    measured = measure_live_bytes(cg.program, inputs)
    assert measured == plan.live_bytes_for(bind_sizes(cg.graph, inputs))
    return cg


def record_values(gm: torch.fx.GraphModule, inputs: list) -> None:
    """Set ``meta["val"]`` on every node from a real run, as make_fx would with fakes."""

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            n.meta["val"] = super().run_node(n)
            return n.meta["val"]

    Recorder(gm).run(*[x.clone() for x in inputs])


def test_split_outputs_alias_their_input():
    """``Tensor(a)[]`` returns keep their alias set in the contained type: split's pieces were
    planned as fresh, and the base they view was freed while they were still read."""
    cg = check(lambda x: torch.cat(list(torch.split(x * 2, 2))[::-1]), [torch.randn(4, 3)])
    base = next(n for n in cg.graph.nodes if n.op.name == "aten::mul.Tensor").outputs[0]
    pieces = next(n for n in cg.graph.nodes if n.op.name == "aten::split.Tensor").outputs
    assert all(cg.plan.alias_root[p] == cg.plan.alias_root[base] for p in pieces)


def test_unsafe_view_shares_its_input_storage():
    """``_unsafe_view`` has no alias annotation but returns a view: it was counted as a new
    storage, so predicted bytes exceeded the measured ones."""
    check(lambda x: aten._unsafe_view.default(x.t().contiguous(), [6]) + 1, [torch.randn(2, 3)])


def test_reshape_that_copies_is_a_fresh_storage():
    """``reshape`` is annotated as a view but copies when no view can express it (here after a
    broadcast add with a transposed operand); the planner took it for a view."""
    g = torch.fx.Graph()
    x0, x1 = g.placeholder("x0"), g.placeholder("x1")
    t = g.call_function(aten.transpose.int, (x1, 0, 1))
    a = g.call_function(aten.add.Tensor, (x0, t))
    r = g.call_function(aten.reshape.default, (a, [2, -1]))
    g.output((g.call_function(aten.mul.Tensor, (r, 2)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    inputs = [torch.randn(2), torch.randn(2, 2, 1)]
    record_values(gm, inputs)  # reshape stays reshape: no re-trace that would decompose it
    cg = check(gm, inputs, opt_level=0)
    assert cg.plan.exact


def test_folded_view_of_constant_shares_its_alias_set():
    """Constant folding turned a view of a constant into a second constant with the same
    storage, in a different alias set."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("c", torch.arange(6.0))

        def forward(self, x):
            return x + self.c.view(2, 3).t().contiguous().sum(0)

    cg = check(M(), [torch.randn(2)])
    consts = [v for v, c in cg.graph.constants.items() if isinstance(c, torch.Tensor)]
    by_storage = {}
    for v in consts:
        by_storage.setdefault(cg.graph.constants[v].untyped_storage().data_ptr(), set()).add(
            cg.plan.alias_root[v]
        )
    assert all(len(roots) == 1 for roots in by_storage.values())


def test_refs_inside_slices_are_read_and_kept_alive():
    """``x[:n]`` at Dynamo level puts a register inside a ``slice``: it was neither substituted
    nor counted as a use."""
    import operator

    g = torch.fx.Graph()
    x, n = g.placeholder("x"), g.placeholder("n")
    m = g.call_function(operator.add, (n, 1))
    g.output(g.call_function(operator.getitem, (x, slice(None, m))))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    for loop in LOOPS:
        cfg = fxrt.CompilerConfig(pure_python=loop == "python", cache=False)
        cg = fxrt.compile_graph(gm, [torch.arange(6.0), 2], cfg)
        torch.testing.assert_close(cg(torch.arange(6.0), 2), torch.arange(3.0))
        add = next(node for node in cg.graph.nodes if node.op.name == "operator.add")
        getitem = cg.graph.nodes.index(
            next(node for node in cg.graph.nodes if node.op.name == "operator.getitem")
        )
        assert cg.plan.last_use[add.outputs[0]] == getitem
