"""The compiled loop (fxrt._speedups through fxrt.exec.native) against the Python loop and eager.

Every program runs through both loops, which must agree with each other and with eager: values,
dtypes, which outputs are the same object or views of the inputs, in-place effects on inputs, and
the errors raised. Tests that need the extension skip, with the reason, when it is not usable;
the fallback machinery (FXRT_PURE_PYTHON, runtime_info, the version check) is tested either way.

Run as a script for the per-node timing of a 200-op chain (eager vs Python loop vs compiled loop):
``.venv/bin/python tests/test_native.py``.
"""

from __future__ import annotations

import copy
import operator
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx
from conftest import LoggingTensor, RecordingFunctionMode, run_in_threads
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.exec import native
from fxrt.exec.interp import PythonLoop
from fxrt.exec.native import NativeLoop
from fxrt.exec.program import Program

STATUS = native.extension_status()
needs_native = pytest.mark.skipif(
    not STATUS.usable, reason=f"compiled loop unavailable: {STATUS.reason}"
)


def assert_same(got: Any, want: Any) -> None:
    """Same nesting, same values and dtypes, same Python scalars."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), type(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, equal_nan=True)
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want), (got, want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert type(got) is type(want) and got == want, (got, want)


def both_loops(program: Program) -> tuple[PythonLoop, NativeLoop]:
    return PythonLoop(program), NativeLoop(program)


def check(
    fn: Callable, *inputs: Any, tracing_mode: str = "real", calls: list[tuple] | None = None
) -> tuple[NativeLoop, Any, Any]:
    """Trace ``fn``, run it through both loops on clones of each input set, compare with eager.
    Returns the native loop and both loops' outputs for the last input set."""
    gm = make_fx(fn, tracing_mode=tracing_mode)(*copy.deepcopy(inputs))
    cg = fxrt.compile_graph(gm, list(inputs))
    py, nat = both_loops(cg.program)
    for args in [inputs, *(calls or [])]:
        want = fn(*copy.deepcopy(args))
        py_args, nat_args = copy.deepcopy(args), copy.deepcopy(args)
        got_py, got_nat = py(list(py_args)), nat(list(nat_args))
        assert_same(got_nat, got_py)
        assert_same(got_nat, want)
        assert_same(list(nat_args), list(py_args))  # in-place effects on the inputs
    return nat, got_py, got_nat


# ---------------------------------------------------------------------------------------------
# Native ops: argument binding and returns


@needs_native
def test_multi_output_ops():
    def f(x):
        a, b, c = torch.split(x, 2, dim=1)
        ln = torch.nn.functional.layer_norm(x, (x.shape[1],))
        m = torch.max(x, 1)
        return a, c, ln, m.values, m.indices, b.sum()

    nat, _, _ = check(f, torch.randn(3, 6))
    assert nat.fallbacks == ()


@needs_native
def test_tensor_list_args():
    def f(x, y):
        return torch.cat([x, y, x], 1), torch.stack([y, x]), torch.cat([x])

    nat, _, _ = check(f, torch.randn(2, 3), torch.randn(2, 3))
    assert nat.fallbacks == ()


@needs_native
def test_kwarg_only_and_default_args():
    def f(x, y):
        return (
            torch.add(x, y, alpha=2),
            x.sum(dim=1, keepdim=True),
            torch.full((2, 3), 1.5, dtype=torch.float64),
            torch.ones_like(x, dtype=torch.int32),
            torch.nn.functional.gelu(x, approximate="tanh"),
            x.to(torch.float16),
            torch.div(x, y, rounding_mode="floor"),
            x + 1,  # a Python number for a Tensor argument (torch.ops allows it for add)
            torch.arange(5, device="cpu"),
        )

    nat, _, _ = check(f, torch.randn(2, 3), torch.rand(2, 3) + 0.5)
    assert nat.fallbacks == ()


@needs_native
def test_numbers_as_tensors_stay_allowed_while_a_python_kernel_runs():
    # prims.fma is a Python custom op; its autograd kernel re-enters the dispatcher with the
    # number it received, which torch.ops accepts only while its numbers-as-tensors flag is set.
    from torch._inductor import inductor_prims  # registers prims.fma

    g = torch.fx.Graph()
    a, c = g.placeholder("a"), g.placeholder("c")
    g.output(g.call_function(inductor_prims.fma, (a, 3.14, c)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    a, c = torch.randn(4), torch.randn(4)
    py, nat = both_loops(fxrt.compile_graph(gm, [a, c]).program)
    assert nat.fallbacks == ()
    torch.testing.assert_close(nat([a, c]), py([a, c]))
    torch.testing.assert_close(nat([a, c]), a * 3.14 + c)


@needs_native
def test_symbolic_int_lists_mixing_constants_and_symints():
    def f(x, y):
        n = x.shape[0]
        return (
            x.reshape(n * 2, -1),
            x.new_zeros(n, 3),
            torch.cat([x, y]).view(-1, y.shape[1]),
            x.expand(2, n, x.shape[1]),
        )

    x, y = torch.randn(4, 6), torch.randn(3, 6)
    nat, _, _ = check(
        f, x, y, tracing_mode="symbolic", calls=[(torch.randn(6, 6), torch.randn(1, 6))]
    )
    # Nothing falls back: the SymInt arithmetic is SYM steps, sym_size and the ops with int lists
    # run natively.
    assert not nat.fallbacks
    assert {i.op for i in nat.program.code if i.KIND == "SYM"} == {"mul"}


@needs_native
def test_scalar_and_none_inputs():
    g = torch.fx.Graph()
    x, s, n, keep, none = (g.placeholder(name) for name in ("x", "s", "n", "keep", "none"))
    aten = torch.ops.aten
    mul = g.call_function(aten.mul.Tensor, (x, s))  # a float register in a Tensor slot
    add = g.call_function(aten.add.Tensor, (mul, x), {"alpha": n})  # an int in a Scalar slot
    clamp = g.call_function(aten.clamp.default, (x, none, s))  # None and a float: Scalar? slots
    total = g.call_function(aten.sum.dim_IntList, (x, [n], keep))  # int list and bool registers
    g.output((mul, add, clamp, total, s, n, keep, none))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    inputs = [torch.randn(2, 3), 0.5, 1, True, None]
    py, nat = both_loops(fxrt.compile_graph(gm, inputs).program)
    assert nat.fallbacks == ()
    assert_same(nat(inputs), py(inputs))
    assert_same(nat(inputs), gm(*inputs))


@needs_native
def test_none_and_scalar_outputs():
    def f(x):
        y = x * 2
        return y, None, x.shape[0], y.sum().item(), y.argmax().item()

    _, got_py, got_nat = check(
        f, torch.randn(3, 2), tracing_mode="symbolic", calls=[(torch.randn(5, 2),)]
    )
    assert got_nat[1] is None and type(got_nat[2]) is int and type(got_nat[3]) is float


@needs_native
def test_duplicated_outputs_and_views_of_inputs():
    def f(x):
        y = x + 1
        return y, y, x, x.view(-1), x.t(), y[1:]

    x = torch.randn(3, 4)
    gm = make_fx(f)(x)
    for loop in both_loops(fxrt.compile_graph(gm, [x]).program):
        out = loop([x])
        assert out[0] is out[1]
        assert out[2] is x
        assert out[3]._base is x and out[4]._base is x
        assert out[3].data_ptr() == x.data_ptr()
        assert out[5]._base is out[0]
        x.add_(1)  # views see writes to their base
        torch.testing.assert_close(out[3], x.view(-1))


@needs_native
def test_in_place_input_mutation():
    def f(x, y, idx, src):
        x.copy_(y)
        y.index_copy_(0, idx, src)
        return x.add_(1), y

    args = (torch.zeros(4, 3), torch.randn(4, 3), torch.tensor([0, 2]), torch.randn(2, 3))
    check(f, *args)

    x = args[0].clone()
    gm = make_fx(f)(*copy.deepcopy(args))
    nat = NativeLoop(fxrt.compile_graph(gm, list(args)).program)
    out = nat([x, *copy.deepcopy(args[1:])])
    assert out[0] is x  # add_ returns its input


@needs_native
def test_autograd_through_both_loops():
    def f(x, w):
        return (x @ w).relu().sum(dim=0)

    x, w = torch.randn(4, 3), torch.randn(3, 5, requires_grad=True)
    gm = make_fx(f)(x, w)
    grads = []
    for loop in both_loops(fxrt.compile_graph(gm, [x, w]).program):
        w.grad = None
        out = loop([x, w])
        assert out.grad_fn is not None
        out.sum().backward()
        grads.append(w.grad.clone())
    w.grad = None
    f(x, w).sum().backward()
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(grads[1], w.grad)


@needs_native
def test_torch_function_is_honoured_like_torch_ops():
    x = torch.randn(3)
    program = fxrt.compile_graph(make_fx(lambda t: t.sin().cos())(x), [x]).program
    py, nat = both_loops(program)
    seen = []
    for loop in (py, nat):
        with RecordingFunctionMode() as mode:
            loop([x])
        seen.append(mode.seen)
    assert seen[0] == seen[1] == ["aten.sin.default", "aten.cos.default"]

    sub = x.as_subclass(LoggingTensor)
    for loop in (py, nat):
        LoggingTensor.seen.clear()
        out = loop([sub])
        assert type(out) is LoggingTensor and "aten.sin.default" in LoggingTensor.seen
    param = torch.nn.Parameter(x)  # a subclass without __torch_function__: still native
    torch.testing.assert_close(nat([param]), x.sin().cos())


# ---------------------------------------------------------------------------------------------
# Python fallbacks inside the compiled loop


def scaled_sum(tensors: list, *, scale: Any) -> torch.Tensor:
    return sum(tensors) * scale


def halves(t: torch.Tensor) -> tuple:
    return t[:, :2], t[:, 2:]


def pair(a: Any, b: Any) -> list:
    return [a, b]


def zero(_: Any) -> int:
    return 0


def fallback_module() -> torch.fx.GraphModule:
    """A graph whose Python fallbacks take register lists and kwargs, return several values or
    opaque Python objects, and feed native ops through the slow conversion path."""
    root = torch.nn.Module()
    root.lin = torch.nn.Linear(4, 2)
    root.w = torch.randn(4, 3)
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    n = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    k = g.call_function(operator.add, (n, 1))
    s = g.call_function(scaled_sum, ([x, y, x],), {"scale": k})
    h = g.call_function(halves, (s,))
    h0, h1 = g.call_function(operator.getitem, (h, 0)), g.call_function(operator.getitem, (h, 1))
    lst = g.call_function(pair, (h0, h1))  # an opaque list register
    cat = g.call_function(torch.ops.aten.cat.default, (lst, 1))  # the list -> Tensor[] slot
    mul = g.call_function(torch.ops.aten.mul.Tensor, (x, k))  # an int register -> Tensor slot
    eps = g.call_function(zero, (x,))
    logit = g.call_function(torch.ops.aten.logit.default, (y,), {"eps": eps})  # int -> float?
    w = g.get_attr("w")
    mm = g.call_function(torch.ops.aten.mm.default, (x, w))
    tr = g.call_method("transpose", (x, 0, 1))
    lin = g.call_module("lin", (x,))
    g.output((s, h0, h1, lst, cat, mul, logit, mm, tr, lin, k, None))
    return torch.fx.GraphModule(root, g)


@needs_native
def test_python_fallbacks():
    gm = fallback_module()
    x, y = torch.randn(3, 4), torch.rand(3, 4)
    py, nat = both_loops(fxrt.compile_graph(gm, [x, y]).program)
    want = gm(x, y)
    got_py, got_nat = py([x, y]), nat([x, y])
    assert_same(got_nat, got_py)
    assert_same(got_nat, want)
    assert type(got_nat[3]) is list and got_nat[3][0] is got_nat[1]
    assert set(nat.fallbacks) == {"scaled_sum", "halves", "pair", "zero", "transpose", "lin"}
    assert [i.op for i in nat.program.code if i.KIND == "SYM"] == ["add"]  # native arithmetic


# ---------------------------------------------------------------------------------------------
# Errors


def raise_value_error(t: torch.Tensor) -> torch.Tensor:
    raise ValueError("bad value")


@needs_native
def test_op_error_names_the_node_on_both_loops():
    def f(x, y):
        return torch.cat([x.sin(), y], 1)

    x, y = torch.randn(2, 3), torch.randn(2, 3)
    cfg = fxrt.CompilerConfig(check_inputs=False)  # so that the op itself fails
    py, nat = both_loops(fxrt.compile_graph(make_fx(f)(x, y), [x, y], cfg).program)
    errors = []
    for loop in (py, nat):
        with pytest.raises(fxrt.ExecutionError) as info:
            loop([x, torch.randn(5, 3)])
        errors.append(info.value)
    e_py, e_nat = errors
    assert str(e_nat) == str(e_py)
    assert "node 'cat' (aten::cat)" in str(e_nat) and "float32[2, 3], float32[5, 3]" in str(e_nat)
    assert type(e_nat.__cause__) is type(e_py.__cause__) is RuntimeError
    assert str(e_nat.__cause__) == str(e_py.__cause__)


@needs_native
def test_fallback_error_names_the_node_on_both_loops():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(raise_value_error, (g.call_function(torch.ops.aten.neg, (x,)),)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    messages = []
    for loop in both_loops(fxrt.compile_graph(gm, [torch.ones(2)]).program):
        with pytest.raises(fxrt.ExecutionError, match="node 'raise_value_error'") as info:
            loop([torch.ones(2)])
        assert isinstance(info.value.__cause__, ValueError)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


@needs_native
def test_wrong_number_of_inputs():
    x = torch.randn(2)
    program = fxrt.compile_graph(make_fx(torch.sin)(x), [x]).program
    messages = []
    for loop in both_loops(program):
        with pytest.raises(TypeError) as info:
            loop([x, x])
        messages.append(str(info.value))
    assert messages[0] == messages[1] == "compiled graph takes 1 inputs, got 2"


# ---------------------------------------------------------------------------------------------
# Threads


@needs_native
@pytest.mark.parametrize("release_gil", [True, False])
def test_threads_share_one_compiled_graph(release_gil):
    def f(x, y):
        z = torch.cat([x, y]).relu()
        return z.reshape(x.shape[0] + y.shape[0], -1).sum(dim=1), z * x.shape[0]

    x, y = torch.randn(3, 4), torch.randn(2, 4)
    gm = make_fx(f, tracing_mode="symbolic")(x, y)
    loop = NativeLoop(fxrt.compile_graph(gm, [x, y]).program, release_gil=release_gil)

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for i in range(20):
            a = torch.randn(seed + 1, 4, generator=gen)
            b = torch.randn(i % 3 + 1, 4, generator=gen)
            assert_same(loop([a, b]), f(a, b))

    run_in_threads(work)


# ---------------------------------------------------------------------------------------------
# Selection, runtime_info and the fallback to the Python loop


def _compile_sin() -> fxrt.CompiledGraph:
    x = torch.randn(3)
    return fxrt.compile_graph(make_fx(torch.sin)(x), [x])


def test_pure_python_switch(monkeypatch):
    monkeypatch.setenv("FXRT_PURE_PYTHON", "1")
    assert _compile_sin().executor == "python"
    assert fxrt.runtime_info()["executor"] == "python"
    assert fxrt.runtime_info()["reason"] == "FXRT_PURE_PYTHON=1"
    monkeypatch.setenv("FXRT_PURE_PYTHON", "0")
    assert _compile_sin().executor == ("cpp" if STATUS.usable else "python")


def test_runtime_info(monkeypatch):
    monkeypatch.delenv("FXRT_PURE_PYTHON", raising=False)
    info = fxrt.runtime_info()
    assert info["torch_version"] == torch.__version__
    assert info["native_available"] is STATUS.usable
    assert info["pure_python"] is False
    if STATUS.usable:
        assert info["executor"] == "cpp"
        assert info["extension_torch_version"] == torch.__version__
        assert info["extension_path"].endswith((".so", ".pyd"))
    else:
        assert info["executor"] == "python" and info["reason"] == STATUS.reason


@needs_native
def test_version_mismatch_falls_back_with_one_warning(monkeypatch):
    monkeypatch.delenv("FXRT_PURE_PYTHON", raising=False)
    monkeypatch.setattr(STATUS.module, "TORCH_VERSION", "1.0.0")
    monkeypatch.setattr(native, "_status", native._load())
    monkeypatch.setattr(native, "_warned", False)
    with pytest.warns(RuntimeWarning, match="built for torch 1.0.0, running torch") as record:
        cgs = [_compile_sin(), _compile_sin()]
    assert len(record) == 1
    assert {cg.executor for cg in cgs} == {"python"}
    torch.testing.assert_close(cgs[0](torch.zeros(3)), torch.zeros(3))
    info = fxrt.runtime_info()
    assert info["executor"] == "python" and "built for torch 1.0.0" in info["reason"]
    with pytest.raises(RuntimeError, match="compiled loop unavailable"):
        NativeLoop(cgs[0].program)


def test_missing_extension_falls_back(monkeypatch):
    monkeypatch.delenv("FXRT_PURE_PYTHON", raising=False)
    monkeypatch.setitem(sys.modules, "fxrt._speedups._loop", None)  # import raises ImportError
    monkeypatch.setattr(native, "_status", native._load())
    monkeypatch.setattr(native, "_warned", False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert _compile_sin().executor == "python"
    assert len(record) == 1 and "compiled loop unavailable" in str(record[0].message)
    assert fxrt.runtime_info()["extension_path"] is None


# ---------------------------------------------------------------------------------------------
# The 200-op chain: correctness here, timing when run as a script


def chain(x: torch.Tensor, n: int = 200) -> torch.Tensor:
    ops = (lambda t: torch.add(t, 1.0), lambda t: torch.mul(t, 0.5), torch.relu, torch.sin)
    for i in range(n):
        x = ops[i % 4](x)
    return x


@needs_native
def test_op_chain_runs_natively():
    nat, _, _ = check(lambda x: chain(x), torch.randn(1, 64))
    assert nat.fallbacks == ()


def bench_chain(
    n: int = 200, repeats: int = 40, inner: int = 20, clock: Callable[[], float] = time.process_time
) -> dict[str, float]:
    """Median microseconds per node of eager, the Python loop and the compiled loop (with and
    without GIL release) on an ``n``-op add/mul/relu/sin chain on a 1x64 tensor, interleaved.
    The default clock is the process's CPU time, which other processes' load does not inflate."""
    x = torch.randn(1, 64)
    cg = fxrt.compile_graph(make_fx(lambda t: chain(t, n))(x), [x])
    py = PythonLoop(cg.program)
    candidates: dict[str, Callable[[], Any]] = {
        "eager": lambda: chain(x, n),
        "python": lambda: py([x]),
    }
    if STATUS.usable:
        nat, nat_gil = NativeLoop(cg.program), NativeLoop(cg.program, release_gil=False)
        candidates["cpp"] = lambda: nat([x])
        candidates["cpp (GIL held)"] = lambda: nat_gil([x])
        candidates["CompiledGraph"] = lambda: cg(x)
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = clock()
            for _ in range(inner):
                fn()
            samples[name].append((clock() - start) / inner / n * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {fxrt.runtime_info()}")
    for clock in (time.process_time, time.perf_counter):
        print(f"{clock.__name__}:")
        for name, us in bench_chain(clock=clock).items():
            print(f"  {name:>14}: {us:.3f} us/node")


@needs_native
def test_sym_steps_follow_python_integer_semantics():
    # SYM steps run in C++ on int64: floor division and modulo round toward negative infinity as
    # Python's do; overflow and division by zero take the Python call, which gives Python's answer
    # or error.
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    ops = (
        operator.add,
        operator.sub,
        operator.mul,
        operator.floordiv,
        operator.mod,
        operator.lt,
        operator.ge,
        torch.sym_max,
        torch.sym_min,
    )
    g.output(
        tuple(g.call_function(op, (a, b)) for op in ops) + (g.call_function(operator.neg, (a,)),)
    )
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    cg = fxrt.compile_graph(gm, [7, 2])
    assert not cg.program.fallbacks
    assert {i.KIND for i in cg.program.code} == {"SYM"}
    py, nat = both_loops(cg.program)
    big = 2**62
    for x, y in [(7, 2), (-7, 2), (7, -2), (-7, -2), (0, 5), (big, 4), (-(2**63), -1), (big, big)]:
        want = gm(x, y)
        assert py([x, y]) == want == nat([x, y]), (x, y)
        assert [type(v) for v in nat([x, y])] == [type(v) for v in want]
    for loop in (py, nat):
        with pytest.raises(ZeroDivisionError):
            loop([3, 0])
