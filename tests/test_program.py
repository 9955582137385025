"""Golden text of converted graphs and lowered programs, and the lifetime plan's numbers."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.exec.program import Free


def compile_fn(fn, *inputs):
    """``fn`` compiled for ``inputs``, after checking it against eager: on ``inputs`` and then on
    other values (the first call's results must survive the second)."""
    cg = fxrt.compile_graph(make_fx(fn)(*inputs), inputs)
    check_against_eager(cg, fn, inputs)
    return cg


def check_against_eager(cg, fn, inputs):
    other = tuple(x * 0.75 + 0.125 for x in inputs)
    first = cg(*inputs)
    kept = torch.utils._pytree.tree_map(torch.clone, first)
    torch.testing.assert_close(first, fn(*inputs))
    torch.testing.assert_close(cg(*other), fn(*other))
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


def golden(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def test_chain_frees_each_intermediate_after_its_last_use():
    def f(x, w):
        a = x @ w
        b = a.relu()
        c = b.t().sum(0)
        d = torch.sigmoid(x)
        return c + d.sum(), d

    cg = compile_fn(f, torch.randn(4, 4), torch.randn(4, 4))
    assert str(cg.program) == golden("""
        program(%x_1, %w_1): 9 registers
          arena  128 bytes, 3 slots
             0  OUT    %mm = aten::mm(%x_1, %w_1) -> arena[0:64] via aten::mm.out
             1  OUT    %relu = aten::relu(%mm) -> arena[0:64] via aten::clamp_min.out(%mm, 0, out=%relu) (inline clamp_min)
             2  FREE   %mm
             3  VIEW   %t = aten::t(%relu) (inline)
             4  OUT    %sum_1 = aten::sum.dim_IntList(%t, [0]) -> arena[64:80] via aten::sum.IntList_out
             5  FREE   %relu, %t
             6  CALL   %sigmoid = aten::sigmoid(%x_1)
             7  CALL   %sum_2 = aten::sum(%sigmoid)
             8  CALL   %add = aten::add.Tensor(%sum_1, %sum_2)
             9  FREE   %sum_1, %sum_2
          return (%add, %sigmoid)
    """)  # noqa: E501
    # 4x4 float32 = 64 bytes: mm and relu are live together (128), then relu + sums, etc.
    assert cg.plan.peak_bytes == 128
    assert cg.plan.live_bytes == (64, 128, 64, 80, 80, 84, 100)
    # mm, relu and sum_1 live in a 128-byte arena (relu written over mm in place, which a
    # pointwise op may do: fxrt.exec.inplace; sum_1 after them, 80 bytes aligned to 128); the
    # outputs sigmoid (64) and add (4) and the 4-byte sum_2 do not.
    assert cg.program.arena.live_bytes(cg.plan) == [128, 128, 128, 128, 192, 196, 212]


def test_graph_text_shows_types():
    def f(x):
        return torch.ops.aten.split.Tensor(x * 2, 2)

    cg = compile_fn(f, torch.randn(4, 4))
    assert cg.graph_text() == golden("""
        graph(%x_1: float32[4, 4]):
          %mul: float32[4, 4] = aten::mul.Tensor(%x_1, 2)
          (%split_0: float32[2, 4], %split_1: float32[2, 4]) = aten::split.Tensor(%mul, 2)
          return [%split_0, %split_1]
    """)


def test_views_of_inputs_and_outputs_are_never_freed():
    def f(x):
        a, b = torch.split(x, 2)  # views of the input
        y = torch.cat([b, a]) * 2
        return y, y.view(-1)  # y's storage is also an output's

    cg = compile_fn(f, torch.randn(4, 4))
    assert str(cg.program) == golden("""
        program(%x_1): 6 registers
          arena  64 bytes, 1 slots
             0  VIEW   (%split_0, %split_1) = aten::split.Tensor(%x_1, 2) (inline)
             1  OUT    %cat = aten::cat([%split_1, %split_0]) -> arena[0:64] via aten::cat.out
             2  CALL   %mul = aten::mul.Tensor(%cat, 2)
             3  FREE   %cat
             4  CALL   %view = aten::view(%mul, [-1])
          return (%mul, %view)
    """)


def test_base_lives_until_its_last_view_is_used():
    def f(x):
        y = x + 1
        v = y.transpose(0, 1)
        z = x * 3  # y is no longer read directly, but its view v is read below
        return (v + z).sum()

    cg = compile_fn(f, torch.randn(3, 3))
    frees = [(pc, ins.regs) for pc, ins in enumerate(cg.program.code) if isinstance(ins, Free)]
    names = cg.program.reg_names
    y_free = next(pc for pc, regs in frees if any(names[r] == "add" for r in regs))
    use_of_v = next(
        pc
        for pc, ins in enumerate(cg.program.code)
        if not isinstance(ins, Free) and cg.program.nodes[ins.node].name == "add_1"
    )
    assert y_free > use_of_v
    torch.testing.assert_close(cg(torch.ones(3, 3)), f(torch.ones(3, 3)))


def test_unused_outputs_of_multi_output_ops_are_freed_at_once():
    def f(x):
        return torch.ops.aten.max.dim(x, 1)[0] + 1

    cg = compile_fn(f, torch.randn(3, 5))
    lines = str(cg.program).splitlines()
    at = next(i for i, line in enumerate(lines) if "= aten::max.dim(%x_1, 1)" in line)
    assert "(%max_1_0, %max_1_1) = aten::max.dim(%x_1, 1)" in lines[at]
    assert "FREE   %max_1_1" in lines[at + 1]
    torch.testing.assert_close(cg(torch.ones(3, 5)), f(torch.ones(3, 5)))


def test_sym_steps_and_fallbacks_are_listed():
    def f(x):
        return x * (x.shape[0] * 2 + 1) * (x.shape[0] / 2)

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3, 2))
    cg = fxrt.compile_graph(gm, None)
    text = str(cg.program)
    # Integer size arithmetic runs natively (SYM); true division has no native step (PYCALL).
    assert "SYM    %mul = operator.mul(%sym_size_int, 2)" in text
    assert "PYCALL %truediv = operator.truediv(" in text
    assert cg.program.fallbacks == ("truediv",)
    assert text.splitlines()[-1] == "fallbacks: truediv"
    torch.testing.assert_close(cg(torch.ones(5, 2)), f(torch.ones(5, 2)))
    torch.testing.assert_close(cg(torch.ones(2, 2)), f(torch.ones(2, 2)))


def test_wrong_number_of_inputs_is_a_clear_error():
    cg = compile_fn(lambda x, y: x + y, torch.randn(2), torch.randn(2))
    with pytest.raises(TypeError, match="takes 2 inputs, got 1"):
        cg(torch.randn(2))


def test_boxed_and_flat_calls_agree():
    cg = compile_fn(lambda x, y: (x - y,), torch.randn(2), torch.randn(2))
    a, b = torch.randn(2), torch.randn(2)
    torch.testing.assert_close(cg([a, b]), cg(a, b))
    torch.testing.assert_close(cg([a, b]), (a - b,))
