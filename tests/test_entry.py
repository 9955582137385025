"""What a call through ``torch.compile`` costs and keeps: the compiled loop is what Dynamo calls
(no Python frame of fxrt's), static inputs (parameters, buffers) stay in the loop's frames
between calls yet every call sees the module's current weights, and one compiled graph or
loaded package serves many threads at once."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import native_available, run_in_threads, skip_unless_executor
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.exec.inputs import InputError
from fxrt.models import DecoderBlock


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("shift", torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) + self.shift).relu()


def compiled_net(executor: str) -> tuple[Net, object, list[fxrt.CompiledGraph]]:
    torch._dynamo.reset()
    model = Net().eval()
    options = {"pure_python": executor == "python"}
    built: list[fxrt.CompiledGraph] = []
    original = fxrt.CompiledGraph.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)

    fxrt.CompiledGraph.__init__ = spy
    try:
        f = torch.compile(model, backend="fxrt", options=options)
        with torch.no_grad():
            f(torch.randn(2, 8))
    finally:
        fxrt.CompiledGraph.__init__ = original
    assert {cg.executor for cg in built} == {executor}
    return model, f, built


def test_torch_compile_calls_the_compiled_loop_itself(executor, monkeypatch):
    skip_unless_executor(executor)
    model, f, _ = compiled_net(executor)
    calls = []
    original = fxrt.CompiledGraph.__call__

    def spy(self, *args):
        calls.append(self)
        return original(self, *args)

    monkeypatch.setattr(fxrt.CompiledGraph, "__call__", spy)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8)
            torch.testing.assert_close(f(x), model(x))
    # The compiled loop is Dynamo's callee; the Python loop is reached through its graph.
    assert len(calls) == (0 if executor == "cpp" else 3)


def test_profilers_see_calls_torch_compile_makes(executor):
    skip_unless_executor(executor)
    model, f, (cg,) = compiled_net(executor)
    x = torch.randn(2, 8)
    with torch.no_grad():
        with fxrt.profile() as prof:
            torch.testing.assert_close(f(x), model(x))
        with torch.profiler.profile() as tp:
            torch.testing.assert_close(f(x), model(x))
        f(x)  # and quiet again afterwards
    assert [c.graph for c in prof.calls] == [cg.name]
    assert {n.name for n in cg.graph.nodes} <= {e.name for e in tp.events()}


def test_static_inputs_stay_live(executor):
    """The loop keeps a parameter's tensor between calls; every change eager sees, it sees."""
    skip_unless_executor(executor)
    model, f, _ = compiled_net(executor)
    gen = torch.Generator().manual_seed(0)

    def check() -> None:
        x = torch.randn(2, 8, generator=gen)
        torch.testing.assert_close(f(x), model(x))

    with torch.no_grad():
        check()
        model.lin.weight.mul_(-2)  # in place
        check()
        model.lin.weight.data = torch.randn(8, 8, generator=gen)  # another tensor's storage
        check()
        model.lin.bias.set_(torch.randn(8, generator=gen))  # set_: another storage
        check()
        model.shift.add_(1)  # a buffer, in place
        check()
        model.lin.weight = nn.Parameter(torch.randn(8, 8, generator=gen))  # a new parameter
        check()
        model.lin.weight.data = model.lin.weight.data.t()  # same storage, other strides
        check()


def test_a_kept_input_changed_in_place_is_still_checked(executor):
    """Called directly, a static input whose sizes change in place is refused by the input
    check as before (the kept tensor is never trusted for its metadata)."""
    skip_unless_executor(executor)
    w, x = torch.randn(4, 4), torch.randn(3, 4)
    config = fxrt.CompilerConfig(pure_python=executor == "python", cache=False)
    cg = fxrt.compile_graph(make_fx(lambda w, x: x @ w)(w, x), [w, x], config)
    run = cg.entry([0])
    torch.testing.assert_close(run([w, x]), x @ w)
    w.data = torch.randn(4, 5)
    with pytest.raises(InputError, match=r"input 0 .*got float32\[4, 5\]"):
        run([w, x])
    w.data = torch.randn(4, 4).t()  # same sizes, other strides
    with pytest.raises(InputError, match=r"input 0 .*stride \(1, 4\)"):
        run([w, x])
    w.data = torch.randn(4, 4)
    torch.testing.assert_close(run([w, x]), x @ w)
    # Why the check is not a pointer/version fast path: .data keeps the tensor, its data pointer
    # and its version counter, and changes its sizes.
    ptr, version = w.data_ptr(), w._version
    w.data = w.data.view(2, 8)
    assert (w.data_ptr(), w._version) == (ptr, version)
    with pytest.raises(InputError, match=r"input 0 .*got float32\[2, 8\]"):
        run([w, x])


@pytest.mark.skipif(not native_available(), reason="the compiled loop is not built")
def test_release_memory_lets_go_of_kept_inputs():
    w, x = torch.randn(4, 4), torch.randn(3, 4)
    cg = fxrt.compile_graph(make_fx(lambda w, x: x @ w)(w, x), [w, x])
    run = cg.entry([0])
    w2 = torch.randn(4, 4)
    torch.testing.assert_close(run([w2, x]), x @ w2)
    gone = weakref.ref(w2)
    del w2
    gc.collect()
    assert gone() is not None  # the idle frame keeps the last static tensor
    cg.release_memory()
    assert gone() is None


def test_eight_threads_share_one_compiled_graph(executor):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    model = DecoderBlock(32, 2).eval()
    options = {"pure_python": executor == "python"}
    f = torch.compile(model, backend="fxrt", options=options)

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # grad mode is per thread
            for _ in range(10):
                x = torch.randn(1, 6, 32, generator=gen)
                torch.testing.assert_close(f(x), model(x))

    work(8)  # compiled before the threads start
    run_in_threads(work, n=8)


def test_eight_threads_share_one_loaded_package(executor, tmp_path):
    skip_unless_executor(executor)
    model = DecoderBlock(32, 2).eval()
    x = torch.randn(1, 6, 32)
    path = tmp_path / "block.fxrt"
    fxrt.export(model, (x,)).save(path)
    pkg = fxrt.load(path, options={"pure_python": executor == "python"})
    assert pkg.executor == executor

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(10):
            a = torch.randn(1, 6, 32, generator=gen)
            with torch.no_grad():
                torch.testing.assert_close(pkg(a), model(a))

    run_in_threads(work, n=8)


class _Ones(nn.Module):  # an int input that is the same size symbol as a tensor dim
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x + torch.ones(n)


class _Scale(nn.Module):  # an int with a range of its own
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n + n


def _int_packages(tmp_path):
    from torch.export import Dim

    for name, model, args, dyn in [
        ("ones", _Ones(), (torch.randn(3), 3), ({0: Dim.DYNAMIC}, Dim.DYNAMIC)),
        ("scale", _Scale(), (torch.randn(3), 4), (None, Dim.DYNAMIC(min=1, max=10))),
    ]:
        path = tmp_path / f"{name}.fxrt"
        fxrt.export(model, args, dynamic_shapes=dyn).save(path)
        yield name, model, path


def test_a_loaded_package_calls_the_compiled_loop_itself(executor, tmp_path, monkeypatch):
    """A call made as the package was exported goes from LoadedModel to the C++ runtime with
    no Python of fxrt's (its checks included), and equals eager; on the Python loop, to the
    runtime's checks and then the loop (``run_on``), again without the model's _call; with a
    profiler on, the call goes through _call."""
    skip_unless_executor(executor)
    taken = []
    face = fxrt.deploy.LoadedModel
    original = face._call
    monkeypatch.setattr(
        face,
        "_call",
        lambda self, args, kwargs: taken.append(1) or original(self, args, kwargs),
    )
    for _, model, path in _int_packages(tmp_path):
        m = fxrt.load(path, options={"pure_python": executor == "python"})
        with torch.inference_mode():
            for n in (2, 5):
                x = torch.randn(n if path.stem == "ones" else 3)
                torch.testing.assert_close(m(x, n), model(x, n))
        assert not taken and m.executor == executor
        with fxrt.profile() as prof:
            m(torch.randn(3), 3)
        assert len(prof.calls) == 1 and taken == [1]
        taken.clear()


@pytest.mark.parametrize("case", ["int differs", "int out of range", "not an int", "dtype"])
def test_a_loaded_package_names_a_bad_input_on_both_loops(case, tmp_path):
    """The checks the compiled loop makes for a loaded package refuse what the Python binder
    refuses, with the binder's words, the same on both loops."""
    ones, scale = [p for _, _, p in _int_packages(tmp_path)]
    path, args, want = {
        "int differs": (ones, (torch.randn(3), 4), "input 'n' (args[1]): 4, but s"),
        "int out of range": (scale, (torch.randn(3), 11), "11 is outside the range"),
        "not an int": (scale, (torch.randn(3), 4.0), "expected an int, got a float"),
        "dtype": (ones, (torch.randn(3, dtype=torch.float64), 3), "input 'x' (args[0]): dtype"),
    }[case]
    messages = []
    for pure in [True] if not native_available() else [True, False]:
        m = fxrt.load(path, options={"pure_python": pure})
        with pytest.raises(InputError) as err:
            m(*args)
        messages.append(str(err.value))
    assert len(set(messages)) == 1, messages
    assert want in messages[0], messages[0]
