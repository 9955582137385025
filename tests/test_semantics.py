"""Eager's answers on the default path: each test here is a case that gave another answer than
eager before it was fixed, run on both loops and compared against eager."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import LoggingTensor, RecordingFunctionMode, skip_unless_executor
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


@pytest.mark.parametrize("cache", [False, True])
def test_compiled_under_inference_mode_then_called_with_grad(executor, cache, tmp_path):
    # The number in ``w * 2`` became a tensor when the program was bound, under inference mode:
    # an inference tensor, which autograd refused to save for backward.
    skip_unless_executor(executor)
    config = fxrt.CompilerConfig(
        pure_python=executor == "python", cache=cache, cache_dir=str(tmp_path)
    )
    f = lambda w: w * 2 + torch.tensor([0.5, 1.0, 1.5])  # noqa: E731
    for _ in range(2 if cache else 1):  # with the cache: cold, then a hit
        with torch.inference_mode():
            gm = make_fx(f)(torch.randn(3))
            cg = fxrt.compile_graph(gm, [torch.randn(3)], config)
        for _ in range(2):
            w = torch.randn(3, requires_grad=True)
            out = cg(w)
            torch.testing.assert_close(out, f(w.detach()))
            out.sum().backward()
            torch.testing.assert_close(w.grad, torch.full((3,), 2.0))
        with torch.inference_mode():  # and inference calls still work
            w = torch.randn(3)
            torch.testing.assert_close(cg(w), f(w))


def test_compiling_under_inference_mode_keeps_grad_mode_off(executor):
    # Leaving inference mode for the compile (so that its tensors are ordinary ones) must not
    # turn grad mode on: folded weights would then carry autograd history.
    skip_unless_executor(executor)
    seen = []

    def post_pass(gm, example_inputs, config):
        seen.append(torch.is_grad_enabled())

    model = ScaledLinear()
    x = torch.randn(2, 4)
    with torch.inference_mode():
        gm = make_fx(model)(x)
        cg = fxrt.compile_graph(
            gm, [x], cfg(executor, freeze=True, post_grad_custom_post_pass=post_pass)
        )
        torch.testing.assert_close(cg(x), model(x))
    assert seen == [False]
    assert all(c.grad_fn is None for c in cg.graph.constants.values())


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


# ----------------------------------------------------------------------------------------------
# Inputs are checked against what the graph was compiled for


def test_wrong_row_count_is_named_not_a_wrong_mean(executor):
    skip_unless_executor(executor)
    x = torch.randn(6, 4)
    gm = make_fx(lambda x: x.sum(0) / x.shape[0])(x)
    cg = fxrt.compile_graph(gm, [x], cfg(executor))
    y = torch.randn(6, 4)
    torch.testing.assert_close(cg(y), y.mean(0))
    with pytest.raises(fxrt.InputError) as info:
        cg(torch.randn(5, 4))
    msg = str(info.value)
    assert "input 0 'x_1': compiled for float32[6, 4] stride (4, 1), got float32[5, 4]" in msg


def test_other_strides_are_refused_where_eager_would_differ(executor):
    skip_unless_executor(executor)
    x = torch.randn(4, 4)
    gm = make_fx(lambda x: x.view(16) * 2)(x)
    cg = fxrt.compile_graph(gm, [x], cfg(executor))
    with pytest.raises(RuntimeError):
        x.t().view(16)  # eager refuses a view of the transposed tensor
    with pytest.raises(
        fxrt.InputError, match=r"stride \(4, 1\), got float32\[4, 4\] stride \(1, 4\)"
    ):
        cg(x.t())
    with pytest.raises(fxrt.InputError, match="got float64"):
        cg(x.double())
    with pytest.raises(fxrt.InputError, match="got a int"):
        cg(3)


def test_check_inputs_false_trusts_the_caller(executor):
    skip_unless_executor(executor)
    x = torch.randn(6, 4)
    gm = make_fx(lambda x: x.relu())(x)
    cg = fxrt.compile_graph(gm, [x], cfg(executor, check_inputs=False))
    y = torch.randn(6, 4)
    torch.testing.assert_close(cg(y), y.relu())


def test_size_symbols_must_bind_consistently(executor):
    skip_unless_executor(executor)
    x, y = torch.randn(3, 2), torch.randn(3, 2)
    gm = make_fx(lambda x, y: x + y, tracing_mode="symbolic")(x, y)
    cg = fxrt.compile_graph(gm, [x, y], cfg(executor))
    a, b = torch.randn(5, 2), torch.randn(5, 2)
    torch.testing.assert_close(cg(a, b), a + b)
    with pytest.raises(fxrt.InputError, match="a size symbol bound to two values"):
        cg(torch.randn(5, 2), torch.randn(4, 2))


# ----------------------------------------------------------------------------------------------
# fxrt's own GELU, deterministic mode


def test_gelu_special_values_match_eager(executor):
    skip_unless_executor(executor)
    x = torch.tensor([float("inf"), 3e38, -3e38, float("-inf"), float("nan"), 1.0, -2.0])
    gm = make_fx(lambda x: torch.nn.functional.gelu(x))(torch.randn(7))
    cg = fxrt.compile_graph(gm, [x], cfg(executor))
    torch.testing.assert_close(cg(x), torch.nn.functional.gelu(x), equal_nan=True)


def test_deterministic_fill_of_uninitialized_memory(executor):
    skip_unless_executor(executor)
    x = torch.randn(8)
    gm = make_fx(lambda x: (torch.empty_like(x), torch.empty(3, 2), x + 1))(x)
    cg = fxrt.compile_graph(gm, [x], cfg(executor))
    cg(x)  # warm any arena with real numbers
    old = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    try:
        torch.utils.deterministic.fill_uninitialized_memory = True
        want = (torch.empty_like(x), torch.empty(3, 2))
        got = cg(x)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = old
    assert want[0].isnan().all() and want[1].isnan().all()
    assert got[0].isnan().all() and got[1].isnan().all()


# ----------------------------------------------------------------------------------------------
# Resources: the arena pool shrinks


def test_arena_pool_keeps_a_few_idle_arenas_and_releases_them(executor):
    """16 threads inside one call at once each need an arena; afterwards only
    ``arena_max_idle`` stay, and ``release_memory()`` frees those too."""
    import threading

    skip_unless_executor(executor)
    barrier = threading.Barrier(16, timeout=60)

    threaded = [True]

    def rendezvous(t):
        if threaded[0]:
            barrier.wait()  # every thread holds its arena here
        return t

    x = torch.randn(64)
    gm = make_fx(lambda x: (x.sin() * 2).cos())(x)
    (mul,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    with gm.graph.inserting_after(mul):
        wait = gm.graph.call_function(rendezvous, (mul,))
    mul.replace_all_uses_with(wait, delete_user_cb=lambda n: n is not wait)
    wait.meta["val"] = mul.meta["val"]
    gm.recompile()
    cg = fxrt.compile_graph(gm, [x], cfg(executor, arena_max_idle=2))
    assert cg.program.arena is not None
    inputs = [torch.randn(64) for _ in range(16)]
    results: list = [None] * 16

    def work(i):
        with torch.no_grad():
            results[i] = cg(inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for x_i, got in zip(inputs, results):
        torch.testing.assert_close(got, (x_i.sin() * 2).cos())
    assert cg._loop.idle_arenas() == 2
    cg.release_memory()
    assert cg._loop.idle_arenas() == 0
    threaded[0] = False
    with torch.no_grad():
        torch.testing.assert_close(cg(inputs[0]), (inputs[0].sin() * 2).cos())


# ----------------------------------------------------------------------------------------------
# Profiling changes nothing


def test_profiling_keeps_torch_function(executor):
    skip_unless_executor(executor)
    x = torch.randn(3)
    cg = fxrt.compile_graph(make_fx(lambda t: t.sin().cos())(x), [x], cfg(executor))
    with fxrt.profile() as prof:
        with RecordingFunctionMode() as mode:
            cg(x)
        out = cg(x.as_subclass(LoggingTensor))
    assert mode.seen == ["aten.sin.default", "aten.cos.default"]
    assert type(out) is LoggingTensor  # as eager's x.sin().cos() of a subclass
    assert type(x.as_subclass(LoggingTensor).sin().cos()) is LoggingTensor
    assert len(prof.calls) == 2


def test_profile_records_only_its_own_thread(executor):
    import threading

    skip_unless_executor(executor)
    x = torch.randn(3)
    cg = fxrt.compile_graph(make_fx(lambda t: t.sin())(x), [x], cfg(executor))
    with fxrt.profile() as prof:
        cg(x)
        t = threading.Thread(target=lambda: [cg(x) for _ in range(5)])
        t.start()
        t.join()
    assert len(prof.calls) == 1


# ----------------------------------------------------------------------------------------------
# Higher-order ops may return views of their operands


def test_cond_branch_returning_a_view_is_not_overwritten(executor):
    """torch.cond whose branches return a view of their operand (tracing refuses to write one,
    but a graph may hold one: the branches here are edited after tracing)."""
    skip_unless_executor(executor)

    def traced(x, p):
        a = x.sin() * 2
        return torch.cond(p, lambda t: t.view(-1).clone(), lambda t: t.view(-1).clone(), (a,))

    def eager(x):
        return (x.sin() * 2).view(-1)

    x1, x2 = torch.randn(2, 3), torch.randn(2, 3)
    p = torch.tensor(True)
    gm = make_fx(traced)(x1, p)
    for branch in (m for m in gm.children() if isinstance(m, torch.fx.GraphModule)):
        for node in list(branch.graph.nodes):
            if node.target is torch.ops.aten.clone.default:
                node.replace_all_uses_with(node.args[0])
                branch.graph.erase_node(node)
        branch.recompile()
    cg = fxrt.compile_graph(gm, [x1, p], cfg(executor))
    first = cg(x1, p)
    second = cg(x2, p)
    torch.testing.assert_close(first, eager(x1))
    torch.testing.assert_close(second, eager(x2))
