"""Eager's answers on the default path: each test here is a case that gave another answer than
eager before it was fixed, run on both loops and compared against eager."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt


def cfg(executor: str, **kw) -> fxrt.CompilerConfig:
    return fxrt.CompilerConfig(pure_python=executor == "python", cache=False, **kw)


class ScaledLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("b", torch.randn(4))

    def forward(self, x):
        return x @ (self.w * 2).t() + self.b


# ----------------------------------------------------------------------------------------------
# Weights are live unless the user freezes them


def test_weights_updated_in_place_are_seen(executor):
    skip_unless_executor(executor)
    torch.manual_seed(0)
    model = ScaledLinear()
    x = torch.randn(2, 4)
    with torch.no_grad():
        cg = fxrt.compile_graph(make_fx(model)(x), [x], cfg(executor))
        torch.testing.assert_close(cg(x), model(x))
        model.w.mul_(-3)
        model.b.add_(1)
        y = torch.randn(2, 4)
        torch.testing.assert_close(cg(y), model(y))


def test_gradients_reach_the_weights(executor):
    skip_unless_executor(executor)
    torch.manual_seed(0)
    model = ScaledLinear()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 4)
    cg = fxrt.compile_graph(make_fx(model)(x), [x], cfg(executor))
    cg(x).sum().backward()
    eager(x).sum().backward()
    assert model.w.grad is not None
    torch.testing.assert_close(model.w.grad, eager.w.grad)


def test_freeze_folds_weights_and_is_documented_as_frozen(executor):
    skip_unless_executor(executor)
    torch.manual_seed(0)
    model = ScaledLinear()
    x = torch.randn(2, 4)
    with torch.no_grad():
        gm = make_fx(model)(x)
        live = fxrt.compile_graph(gm, [x], cfg(executor))
        frozen = fxrt.compile_graph(gm, [x], cfg(executor, freeze=True))
        torch.testing.assert_close(frozen(x), model(x))
    assert len(frozen.graph.nodes) < len(live.graph.nodes)  # mul and t were folded


def test_constants_folded_under_inference_mode_work_with_grad(executor):
    skip_unless_executor(executor)
    torch.manual_seed(0)
    model = ScaledLinear()
    x = torch.randn(2, 4)
    with torch.inference_mode():
        gm = make_fx(model)(x)
        cg = fxrt.compile_graph(gm, [x], cfg(executor, freeze=True))
    xg = torch.randn(2, 4, requires_grad=True)
    out = cg(xg)
    out.sum().backward()
    want = torch.ones(2, 4) @ (model.w.detach() * 2)
    torch.testing.assert_close(xg.grad, want)


def test_tensor_literals_still_fold_through_torch_compile(executor):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    f = torch.compile(
        lambda x: x * (torch.tensor([1.0, 2.0]) * 3),
        backend="fxrt",
        options={"pure_python": executor == "python", "cache": False},
    )
    x = torch.randn(2)
    torch.testing.assert_close(f(x), x * torch.tensor([3.0, 6.0]))


# ----------------------------------------------------------------------------------------------
# Inputs may alias one another


def test_cse_does_not_merge_reads_across_a_write_to_an_aliasing_input(executor):
    def f(x, y):
        a = y * 2
        x.mul_(3)
        return a + y * 2

    base = torch.ones(4)
    eager_base = base.clone()
    want = f(eager_base[:], eager_base[:])
    skip_unless_executor(executor)
    x0 = torch.ones(4)
    gm = make_fx(f)(x0, x0.clone())
    cg = fxrt.compile_graph(gm, [x0, x0.clone()], cfg(executor))
    got = cg(base[:], base[:])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(base, eager_base)


# ----------------------------------------------------------------------------------------------
# Exceptions keep eager's type


def test_op_errors_keep_their_type_and_name_the_node(executor):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    emb = torch.nn.Embedding(10, 4)
    f = torch.compile(emb, backend="fxrt", options={"pure_python": executor == "python"})
    with torch.no_grad():
        f(torch.tensor([1, 2]))
        with pytest.raises(IndexError) as info:
            f(torch.tensor([1, 12]))
        with pytest.raises(fxrt.ExecutionError, match="node 'embedding'"):
            f(torch.tensor([1, 12]))
    with pytest.raises(IndexError):
        emb(torch.tensor([1, 12]))  # eager raises the same type
    assert "index out of range" in str(info.value)
    assert isinstance(info.value.__cause__, IndexError)
