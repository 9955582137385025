"""fxrt as Inductor's FX host-wrapper executor (``fxrt.register_fx_wrapper``).

Models are compiled by ``torch.compile`` with Inductor's defaults after registration, on both fxrt
loops, and compared with eager; the program listing and a call counter show that fxrt ran the host
graph. Registration must be idempotent and leave Inductor exactly as it found it. Inductor CPU
compiles take seconds each, so each (model, loop) pair is compiled once per module and reused.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import shutil
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import EXECUTORS, LoggingDispatchMode, skip_unless_executor
from torch import nn
from torch._inductor import config as inductor_config
from torch._inductor.codegen import common as inductor_common
from torch._inductor.codegen.wrapper_fxir import WrapperFxCodegen

import fxrt
from fxrt.exec.program import Call, Free, Kernel, PyCall, input_refs
from fxrt.inductor import FxrtWrapperCodegen, compiled_host_graphs
from fxrt.models import DecoderBlock, workloads
from fxrt.ops.c_kernels import CKernel, param_kinds

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="Inductor's CPU backend needs a C++ compiler",
)

DEVICES = ("cpu", "cuda")


def _snapshot() -> tuple[Any, ...]:
    inductor_common.init_backend_registration()
    return (
        inductor_config.fx_wrapper,
        {d: inductor_common.device_codegens.get(d) for d in DEVICES},
    )


@pytest.fixture(autouse=True)
def leave_inductor_as_found() -> Iterator[None]:
    """Every test ends unregistered, with Inductor's registrations as they were before it."""
    before = _snapshot()
    yield
    fxrt.unregister_fx_wrapper()
    after = _snapshot()
    assert after[0] == before[0]
    assert all(after[1][d] is before[1][d] for d in DEVICES)


@contextlib.contextmanager
def registered(config: fxrt.CompilerConfig | None = None) -> Iterator[None]:
    fxrt.register_fx_wrapper(config)
    try:
        yield
    finally:
        fxrt.unregister_fx_wrapper()


@contextlib.contextmanager
def capturing_modules() -> Iterator[list[Any]]:
    """The modules Inductor compiles inside the block (its FX graph cache is off, so it does
    compile): a Python module for its own wrapper, a FileBackedGraphModule for an FX wrapper."""
    with inductor_config.patch(fx_graph_cache=False), fxrt.inductor.capturing_modules() as found:
        yield found


@contextlib.contextmanager
def counting_host_calls() -> Iterator[list[int]]:
    """Counts calls of any CompiledGraph: Inductor calls the host graph's directly."""
    count = [0]
    original = fxrt.CompiledGraph.__call__

    def spy(self: fxrt.CompiledGraph, *args: Any) -> Any:
        count[0] += 1
        return original(self, *args)

    fxrt.CompiledGraph.__call__ = spy
    try:
        yield count
    finally:
        fxrt.CompiledGraph.__call__ = original


def check_frees(program: Any) -> None:
    """No instruction reads a register after a FREE released it, and outputs are never freed:
    fxrt's lifetime plan must respect Inductor's buffer reuse and in-place kernel writes."""
    freed: set[int] = set()
    for ins in program.code:
        if isinstance(ins, Free):
            freed.update(ins.regs)
            continue
        assert not freed & set(input_refs(ins)), f"reads a freed register: {ins}"
        freed.difference_update(ins.outputs)
    out = {r.id for r in _refs(program.output)}
    assert not out & freed


def _refs(tree: Any) -> list[Any]:
    from fxrt.ir.graph import Ref

    if isinstance(tree, Ref):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [r for x in tree for r in _refs(x)]
    return []


def perturbed(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The same inputs with other values (floating-point ones; indices stay valid)."""
    return tuple(
        x * 0.75 + 0.125 if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for x in inputs
    )


def fresh_entry(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``fn(*args)`` behind a function with a code object of its own. Dynamo caches compiled code
    per code object (and its guards accept any instance of a module class), so this keeps each
    compile separate without resetting Dynamo, which would also drop the compiled code of the
    models this module reuses across tests."""
    namespace = {"fn": fn}
    exec(compile("def entry(*args):\n    return fn(*args)\n", f"<{tag}>", "exec"), namespace)
    return namespace["entry"]


# --- models ------------------------------------------------------------------------------------


class ConvNet(nn.Module):
    """Extern convolution kernels plus fused C++ pointwise/reduction kernels."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = torch.relu(self.conv2(x))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


def _kv_decoder() -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    return DecoderBlock(64, 4, cache_len=16).eval(), (torch.randn(1, 2, 64), torch.tensor([3, 4]))


def _convnet() -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    model = ConvNet().eval()
    model.bn1.running_mean.uniform_(-0.5, 0.5)
    model.bn1.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(2, 3, 16, 16),)


def _workload(prefix: str) -> Callable[[], tuple[nn.Module, tuple[Any, ...]]]:
    def make() -> tuple[nn.Module, tuple[Any, ...]]:
        return next(v for k, v in workloads().items() if k.startswith(prefix))

    return make


MODELS = {
    "W1": _workload("W1"),
    "W2": _workload("W2"),
    "W3": _workload("W3"),
    "convnet": _convnet,
    "decoder_kv": _kv_decoder,
}


class Compiled:
    """One model compiled with Inductor + fxrt; ``eager`` is an untouched copy to compare with."""

    def __init__(self, name: str, executor: str):
        model, self.inputs = MODELS[name]()
        self.eager = copy.deepcopy(model)
        self.model = model
        before = {id(cg) for cg in compiled_host_graphs()}
        with registered(fxrt.CompilerConfig(pure_python=executor == "python")):
            self.fn = torch.compile(fresh_entry(model, f"{name}-{executor}"))
            with torch.inference_mode():
                self.first = self.fn(*self.inputs)
        self.host_graphs = [cg for cg in compiled_host_graphs() if id(cg) not in before]


_compiled: dict[tuple[str, str], Compiled] = {}


def compiled(name: str, executor: str) -> Compiled:
    skip_unless_executor(executor)
    key = (name, executor)
    if key not in _compiled:
        _compiled[key] = Compiled(name, executor)
    return _compiled[key]


# --- registration ------------------------------------------------------------------------------


def test_register_installs_subclass_for_cpu_and_cuda_and_is_idempotent():
    fx_before, entries = _snapshot()
    fxrt.register_fx_wrapper()
    fxrt.register_fx_wrapper()  # a second call changes nothing
    assert inductor_config.fx_wrapper is True
    assert fxrt.inductor.is_registered()
    for device in DEVICES:
        cls = inductor_common.get_wrapper_codegen_for_device(device, fx_wrapper=True)
        assert cls is FxrtWrapperCodegen and issubclass(cls, WrapperFxCodegen)
        # the rest of the device's registration is untouched
        now, was = inductor_common.device_codegens[device], entries[device]
        assert now.scheduling is was.scheduling
        assert now.wrapper_codegen is was.wrapper_codegen
        assert now.cpp_wrapper_codegen is was.cpp_wrapper_codegen
    fxrt.unregister_fx_wrapper()
    fxrt.unregister_fx_wrapper()  # idempotent too
    assert not fxrt.inductor.is_registered()
    assert inductor_config.fx_wrapper is fx_before
    for device in DEVICES:
        assert inductor_common.device_codegens[device] is entries[device]
        cls = inductor_common.get_wrapper_codegen_for_device(device, fx_wrapper=True)
        assert cls is WrapperFxCodegen


def test_unregister_restores_a_user_set_fx_wrapper():
    with inductor_config.patch(fx_wrapper=True):
        fxrt.register_fx_wrapper()
        fxrt.unregister_fx_wrapper()
        assert inductor_config.fx_wrapper is True
    with inductor_config.patch(fx_wrapper=False):
        fxrt.register_fx_wrapper()
        fxrt.unregister_fx_wrapper()
        assert inductor_config.fx_wrapper is False


def test_register_replaces_only_the_config():
    fxrt.register_fx_wrapper(fxrt.CompilerConfig(pure_python=True))
    entries = {d: inductor_common.device_codegens[d] for d in DEVICES}
    fxrt.register_fx_wrapper(fxrt.CompilerConfig(pure_python=False))
    assert all(inductor_common.device_codegens[d] is entries[d] for d in DEVICES)
    from fxrt.inductor.fx_wrapper import _active_config

    assert _active_config().pure_python is False


def test_inductor_unchanged_without_registration():
    def fn(x):
        return torch.relu(x * 2.0 + 1.0)

    x = torch.randn(4, 8)
    graphs_before = fxrt.inductor.stats["host_graphs"]

    def plain_compile(tag: str) -> Any:
        with capturing_modules() as mods:
            torch.testing.assert_close(torch.compile(fresh_entry(fn, tag))(x), fn(x))
        assert len(mods) == 1
        return mods[0]

    # Never registered: Inductor's own Python wrapper module.
    assert isinstance(plain_compile("plain-1"), types.ModuleType)
    # Registered then unregistered: the same again, and fxrt compiled nothing.
    fxrt.register_fx_wrapper()
    fxrt.unregister_fx_wrapper()
    assert isinstance(plain_compile("plain-2"), types.ModuleType)
    assert fxrt.inductor.stats["host_graphs"] == graphs_before
    # fx_wrapper set by hand, fxrt not registered: upstream's implementation, which rejects
    # Inductor's C++ CPU kernels.
    with inductor_config.patch(fx_wrapper=True), capturing_modules():
        with pytest.raises(Exception, match="FX conversion only supports Triton kernels"):
            torch.compile(fresh_entry(fn, "upstream-fx"))(x)
    assert fxrt.inductor.stats["host_graphs"] == graphs_before


# --- models on both loops ----------------------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", ["W1", "W2", "W3", "convnet"])
def test_model_matches_eager_and_runs_in_fxrt(name, executor):
    c = compiled(name, executor)
    # Other values, made outside inference mode like the first inputs so Dynamo's guards hold.
    other = perturbed(c.inputs)
    with torch.inference_mode():
        expected = c.eager(*c.inputs)
        torch.testing.assert_close(c.first, expected)
        with counting_host_calls() as calls:
            again = c.fn(*c.inputs)
            got_other = c.fn(*other)
        expected_other = c.eager(*other)
    # ``again`` is checked after the call on other values: no result lives in reused memory.
    torch.testing.assert_close(again, expected)
    torch.testing.assert_close(got_other, expected_other)
    assert calls[0] == 2, "Inductor did not call fxrt's host graph"
    assert len(c.host_graphs) == 1
    cg = c.host_graphs[0]
    assert cg.executor == executor
    listing = str(cg.program)
    # Inductor's C++ kernels are KERNEL instructions: the compiled loop calls their C functions
    # (the Python loop their bindings); none is left a Python fallback ...
    kernels = [i for i in cg.program.code if isinstance(i, Kernel)]
    assert kernels and all(cg.program.nodes[i.node].name.startswith("cpp_") for i in kernels)
    assert all(i.target.address and len(i.args) == len(i.target.params) for i in kernels)
    assert "  KERNEL %cpp_" in listing and "fallbacks: cpp_" not in listing
    assert not cg.program.demotions
    # ... while allocations, views and extern kernels run as native ATen calls.
    natives = {i.target for i in cg.program.code if isinstance(i, Call)}
    assert torch.ops.aten.empty_strided.default in natives
    if name != "W1":
        # Views of weights and buffers are reinterpret_tensor aliases.
        assert torch.ops.fxrt.reinterpret_tensor.default in natives
        assert natives & {
            torch.ops.aten.addmm.default,  # an allocation folded into addmm.out
            torch.ops.aten.addmm.out,
            torch.ops.aten.convolution.default,
            torch.ops.mkldnn._convolution_pointwise.default,
        }
    if name in ("W2", "W3"):
        # Allocations filled by an extern kernel's out= are folded into its functional form.
        assert torch.ops.aten.addmm.default in natives
    check_frees(cg.program)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_kv_cache_writes_into_inputs(executor):
    # The decoder step writes its KV cache (graph inputs) in place from inside a C++ kernel,
    # and later kernels read it: fxrt must keep those writes and their order.
    c = compiled("decoder_kv", executor)
    x, pos = c.inputs
    # Made outside inference mode like the first inputs, so Dynamo's guards still hold (an
    # inference tensor would recompile, and without fxrt registered).
    x2, pos2 = torch.randn_like(x), torch.tensor([5, 6])
    with torch.inference_mode():
        expected = c.eager(x, pos)
        torch.testing.assert_close(c.first, expected)
        expected2 = c.eager(x2, pos2)
        with counting_host_calls() as calls:
            got2 = c.fn(x2, pos2)
    assert calls[0] == 1
    torch.testing.assert_close(got2, expected2)
    torch.testing.assert_close(c.model.k_cache, c.eager.k_cache)
    torch.testing.assert_close(c.model.v_cache, c.eager.v_cache)
    assert c.model.k_cache[:, :, 3:7].abs().sum() > 0  # both steps were written
    check_frees(c.host_graphs[0].program)


def test_loops_agree_on_the_same_program():
    skip_unless_executor("cpp")
    from fxrt.exec.interp import PythonLoop

    c = compiled("W3", "cpp")
    cg = c.host_graphs[0]
    seen: list[list[Any]] = []
    original = fxrt.CompiledGraph.__call__

    def record(self: fxrt.CompiledGraph, *args: Any) -> Any:
        seen.append(list(args[0]))
        return original(self, *args)

    fxrt.CompiledGraph.__call__ = record
    try:
        with torch.inference_mode():
            c.fn(*c.inputs)
    finally:
        fxrt.CompiledGraph.__call__ = original
    with torch.inference_mode():
        python_result = PythonLoop(cg.program)(seen[0])
        torch.testing.assert_close(python_result, cg(seen[0]))
        # The host graph's first output is the model's, before AOTAutograd's runtime wrapper
        # restores the view the model returns (here a flat [16, 128] for [1, 16, 128]).
        want = c.eager(*c.inputs)
        assert python_result[0].numel() == want.numel()
        torch.testing.assert_close(python_result[0].reshape(want.shape), want)


def test_host_graph_rewrites_are_pipeline_stages(tmp_path):
    """Inductor's four host-graph rewrites run as declared stages of the pipeline: recorded,
    timed, in order before the conversion, and dumped like every other stage."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    before = {id(cg) for cg in compiled_host_graphs()}
    config = fxrt.CompilerConfig(dump_dir=str(tmp_path))
    with registered(config), torch.inference_mode():
        fn = torch.compile(fresh_entry(model, "stages"))
        for _ in range(2):
            x = torch.randn(4, 16)
            torch.testing.assert_close(fn(x), model(x))
    (cg,) = [g for g in compiled_host_graphs() if id(g) not in before]
    names = [r.name for r in cg.stage_records]
    rewrites = ["rewrite_to_aten", "use_functional_variants", "simplify_views"]
    rewrites.append("use_reinterpret_views")
    assert names[: names.index("from_fx")] == rewrites
    assert any(r.changed for r in cg.stage_records if r.name in rewrites)
    dumped = {p.name for folder in tmp_path.iterdir() for p in folder.iterdir()}
    for name in rewrites:
        assert any(d.endswith(f"after_{name}.txt") for d in dumped), (name, sorted(dumped))
    # An ordinary graph never runs them.
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: x.sin() + 1)(torch.randn(3))
    plain = fxrt.compile_graph(gm, [torch.randn(3)])
    assert not set(rewrites) & {r.name for r in plain.stage_records}


@pytest.mark.parametrize("executor", EXECUTORS)
def test_dynamic_shapes_pass_sizes_to_kernels(executor):
    # With symbolic sizes, kernels take size arguments the host graph computes from its inputs.
    skip_unless_executor(executor)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32)).eval()
    before = {id(cg) for cg in compiled_host_graphs()}
    with registered(fxrt.CompilerConfig(pure_python=executor == "python")):
        fn = torch.compile(fresh_entry(model, f"dynamic-{executor}"), dynamic=True)
        with torch.inference_mode():
            for shape in ((2, 16), (5, 16)):
                x = torch.randn(shape)
                torch.testing.assert_close(fn(x), model(x))
    (cg,) = [g for g in compiled_host_graphs() if id(g) not in before]
    inputs = [cg.graph.values[v] for v in cg.graph.inputs]
    assert any(v.kind.value == "sym" for v in inputs), "expected symbolic size inputs"
    sym_regs = {v.id for v in inputs if v.kind.value == "sym"}
    kernel_args = [set(input_refs(i)) for i in cg.program.code if isinstance(i, Kernel)]
    assert any(args & sym_regs for args in kernel_args), "no kernel received a size argument"


def test_c_kernel_parameters():
    assert param_kinds(["const float*", "float*", "const int64_t", "int64_t", "const bool*"]) == (
        "ptr",
        "ptr",
        "int",
        "int",
        "ptr",
    )
    # A float parameter travels in a floating-point register: no native call.
    assert param_kinds(["const float*", "const float"]) is None
    assert CKernel("k", lambda x, y: None, ["const float*", "const float"]).address is None
    # A binding that is not a compiled library's has no C function to call.
    k = CKernel("k", lambda x: x + 1, ["const float*"])
    assert k.address is None and k(1) == 2


def _embedding_kernel_graph(executor: str) -> tuple[Callable[..., Any], fxrt.CompiledGraph]:
    def fn(idx, w, x):
        return torch.nn.functional.embedding(idx, w).relu() * x

    before = {id(cg) for cg in compiled_host_graphs()}
    with registered(fxrt.CompilerConfig(pure_python=executor == "python")):
        compiled_fn = torch.compile(fresh_entry(fn, f"embedding-{executor}"), dynamic=True)
        w = torch.randn(10, 4)
        for n in (3, 5):
            idx, x = torch.randint(0, 10, (n,)), torch.randn(n, 4)
            torch.testing.assert_close(compiled_fn(idx, w, x), fn(idx, w, x))
    (cg,) = [g for g in compiled_host_graphs() if id(g) not in before]
    return compiled_fn, cg


@pytest.mark.parametrize("executor", EXECUTORS)
def test_kernel_errors_name_the_node_and_the_graph_recovers(executor):
    # The kernel checks its indices and throws from C++: the compiled loop, which calls it
    # directly, raises what the binding raises, naming the node, and the next call works.
    skip_unless_executor(executor)
    compiled_fn, cg = _embedding_kernel_graph(executor)
    (kernel,) = [i for i in cg.program.code if isinstance(i, Kernel)]
    name = cg.program.nodes[kernel.node].name
    w = torch.randn(10, 4)
    with pytest.raises(RuntimeError, match=rf"(?s){name}.*index out of bounds"):
        compiled_fn(torch.tensor([1, 12, 3]), w, torch.randn(3, 4))
    idx, x = torch.tensor([9, 0, 4, 4]), torch.randn(4, 4)
    want = torch.nn.functional.embedding(idx, w).relu() * x
    torch.testing.assert_close(compiled_fn(idx, w, x), want)


def test_kernel_runs_its_binding_under_torch_function_modes(monkeypatch):
    # A call that __torch_function__ must see runs every instruction's Python form: the
    # kernel's binding, with the same answers.
    skip_unless_executor("cpp")
    compiled_fn, cg = _embedding_kernel_graph("cpp")
    seen_inputs: list[list[Any]] = []
    original = fxrt.CompiledGraph.__call__

    def record(self: fxrt.CompiledGraph, *args: Any) -> Any:
        seen_inputs.append(list(args[0]))
        return original(self, *args)

    monkeypatch.setattr(fxrt.CompiledGraph, "__call__", record)
    idx, x, w = torch.tensor([2, 7]), torch.randn(2, 4), torch.randn(10, 4)
    want = compiled_fn(idx, w, x)
    monkeypatch.undo()
    torch.testing.assert_close(want, torch.nn.functional.embedding(idx, w).relu() * x)
    seen: list[Any] = []

    class Seeing(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Seeing():
        got = cg(seen_inputs[0])
    torch.testing.assert_close(got, cg(seen_inputs[0]))
    assert seen, "the mode saw no call"
    assert any(isinstance(i, Kernel) for i in cg.program.code)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_training_forward_and_backward(executor):
    # Registration applies to every graph Inductor compiles, backward graphs included.
    skip_unless_executor(executor)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    eager = copy.deepcopy(model)
    x = torch.randn(3, 16)
    before = {id(cg) for cg in compiled_host_graphs()}
    with registered(fxrt.CompilerConfig(pure_python=executor == "python")):
        out = torch.compile(fresh_entry(model, f"train-{executor}"))(x)
        out.sum().backward()
    expected = eager(x)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    new = [g for g in compiled_host_graphs() if id(g) not in before]
    assert len(new) == 2 and {g.executor for g in new} == {executor}  # forward and backward


@pytest.mark.parametrize("executor", EXECUTORS)
def test_cond_branches_with_cpp_kernels(executor):
    # Branches are FX subgraphs holding C++ kernel calls; the host graph calls torch.cond.
    skip_unless_executor(executor)

    def fn(x):
        branches = (lambda t: (t.sin() * 2.0,), lambda t: (t.cos() + 1.0,))
        return torch.cond(x.sum() > 0, *branches, (x,))[0] + 1.0

    x = torch.randn(4, 8)
    before = {id(cg) for cg in compiled_host_graphs()}
    with registered(fxrt.CompilerConfig(pure_python=executor == "python")):
        compiled_fn = torch.compile(fresh_entry(fn, f"cond-{executor}"))
        for inp in (x.abs(), -x.abs()):  # both branches
            torch.testing.assert_close(compiled_fn(inp), fn(inp))
    (cg,) = [g for g in compiled_host_graphs() if id(g) not in before]
    listing = str(cg.program)
    assert "higher_order.cond" in listing and "assert_alignment" in listing


def _fake_graph() -> tuple[torch.fx.Graph, Callable[..., torch.fx.Node]]:
    """An empty FX graph and ``add(target, *args, val=..., **kwargs)`` that appends a node and
    sets its fake ``val``, as Inductor's FX converter does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode, graph = FakeTensorMode(), torch.fx.Graph()

    def add(target: Any, *args: Any, val: Any = None, **kwargs: Any) -> torch.fx.Node:
        node = (
            graph.placeholder(target)
            if isinstance(target, str)
            else graph.call_function(target, args, kwargs)
        )
        node.meta["val"] = mode.from_tensor(val) if isinstance(val, torch.Tensor) else val
        return node

    return graph, add


def test_out_calls_take_over_their_fresh_allocation():
    from fxrt.passes.host_graph import use_functional_variants

    aten = torch.ops.aten
    graph, add = _fake_graph()
    a, b = add("a", val=torch.randn(4, 3)), add("b", val=torch.randn(3, 5))
    alloc = dict(dtype=torch.float32, device=torch.device("cpu"))
    fresh = add(aten.empty_strided.default, [4, 5], [5, 1], val=torch.empty(4, 5), **alloc)
    add(aten.mm.out, a, b, out=fresh)
    # Written (here: zeroed) before the out= call: must stay an out= call into that buffer.
    used = add(aten.empty_strided.default, [4, 5], [5, 1], val=torch.empty(4, 5), **alloc)
    add(aten.zero_.default, used, val=torch.empty(4, 5))
    add(aten.mm.out, a, b, out=used)
    # Column-major: the functional mm would not produce these strides.
    strided = add(aten.empty_strided.default, [4, 5], [1, 4], val=torch.empty(5, 4).t(), **alloc)
    add(aten.mm.out, a, b, out=strided)
    graph.output((fresh, used, strided))
    gm = torch.fx.GraphModule({}, graph)
    x, y = torch.randn(4, 3), torch.randn(3, 5)
    expected = gm(x, y)
    assert use_functional_variants(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.mm.default) == 1 and targets.count(aten.mm.out) == 2
    assert targets.count(aten.empty_strided.default) == 2
    for got, want in zip(gm(x, y), expected):
        torch.testing.assert_close(got, want)
        assert got.stride() == want.stride()


def test_views_the_host_graph_does_not_need_are_dropped():
    from fxrt.passes.host_graph import simplify_views

    aten = torch.ops.aten
    graph, add = _fake_graph()
    base = add("base", val=torch.randn(2, 8))

    def view(src, size, stride, offset):
        val = torch.empty_strided((16,), (1,)).as_strided(size, stride, offset)
        return add(aten.as_strided.default, src, size, stride, offset, val=val)

    flat = view(base, [16], [1], 0)
    again = view(flat, [2, 8], [8, 1], 0)  # a view of a view: rebased on ``base``, then identity
    shifted = view(base, [8], [1], 8)
    reader = add(aten.neg.default, again, val=torch.empty(2, 8))
    twin = view(base, [8], [1], 8)  # made again: the first one serves
    kernel = add(aten.add.Tensor, flat, twin)  # stands in for a C++ kernel call
    kernel.meta["fxrt_pointer_args"] = (0, 1)
    out = view(base, [2, 8], [8, 1], 0)
    alloc = dict(dtype=torch.float32, device=torch.device("cpu"))
    buf = add(aten.empty_strided.default, [2, 8], [8, 1], val=torch.empty(2, 8), **alloc)
    buf_out = view(buf, [2, 8], [8, 1], 0)
    graph.output((reader, kernel, out, buf_out))
    gm = torch.fx.GraphModule({}, graph)
    # ``again`` is ``base``, the kernel reads ``base``'s data pointer, ``twin`` is ``shifted``,
    # ``buf_out`` is ``buf``
    assert simplify_views(gm) == 4
    assert not {again, flat, twin, buf_out} & set(gm.graph.nodes)
    assert reader.args == (base,)
    assert kernel.args == (base, shifted)  # pointer arg at its input's offset: the input itself
    output = next(iter(gm.graph.find_nodes(op="output")))
    # An identity view of an input the caller gets is kept; of the graph's own buffer, it is the
    # buffer.
    assert output.args[0] == (reader, kernel, out, buf)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_views_become_reinterpret_tensor_with_relative_offsets(executor):
    from torch._functorch._aot_autograd.runtime_wrappers import _AnalyzeCustomOpInputOutputMode

    from fxrt.passes.host_graph import use_reinterpret_views

    skip_unless_executor(executor)
    aten = torch.ops.aten
    graph, add = _fake_graph()
    storage = torch.randn(32)
    base_val = storage[4:20]  # an input at storage offset 4
    base = add("base", val=base_val)
    weight_t = add(aten.as_strided.default, base, [4, 4], [1, 4], 4, val=base_val.view(4, 4).t())
    shifted = add(aten.as_strided.default, base, [2, 4], [4, 1], 12, val=base_val[8:].view(2, 4))
    prod = add(aten.mm.default, weight_t, weight_t, val=torch.empty(4, 4))
    # A returned view of the graph's own buffer is Inductor's reinterpret_tensor; ``shifted``,
    # a returned view of an input, stays a real view.
    prod_t = add(aten.as_strided.default, prod, [4, 4], [1, 4], 0, val=torch.empty(4, 4).t())
    graph.output((prod_t, shifted))
    gm = torch.fx.GraphModule({}, graph)
    x = torch.randn(32)[4:20]
    expected = gm(x)
    assert use_reinterpret_views(gm) == 2
    assert weight_t.target is torch.ops.fxrt.reinterpret_tensor.default
    assert weight_t.args == (base, [4, 4], [1, 4], 0)  # absolute 4 minus the base's 4
    assert prod_t.target is torch.ops.fxrt.reinterpret_tensor.default
    assert shifted.target is aten.as_strided.default
    cg = fxrt.compile_graph(gm, [base_val], fxrt.CompilerConfig(pure_python=executor == "python"))
    assert cg.executor == executor
    torch.testing.assert_close(cg(x), expected)
    other = torch.randn(32)[4:20]
    got_t, got_shifted = cg(other)
    torch.testing.assert_close((got_t, got_shifted), gm(other))
    assert got_t.stride() == (1, 4) and got_shifted._base is not None
    assert got_shifted.data_ptr() == other.data_ptr() + 8 * other.element_size()
    # Under a TorchDispatchMode the view is the op's own call, which the mode sees as the
    # as_strided it decomposes into.
    with LoggingDispatchMode() as mode:
        torch.testing.assert_close(cg(x), expected)
    assert "aten.as_strided.default" in mode.seen
    # AOTAutograd's first-call check of custom ops accepts it: its schema says it is a view.
    with (
        torch._functorch.config.patch(error_on_custom_op_aliasing=True),
        _AnalyzeCustomOpInputOutputMode(),
    ):
        torch.testing.assert_close(cg(x), expected)


# --- device-library fused kernels --------------------------------------------------------------


class CountingKernel:
    """A device library's fused kernel: runs ``fn`` and counts calls."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self.fn(*args)


class FusedLibraryWrapper(FxrtWrapperCodegen):
    """Stands in for a device library's wrapper codegen: it builds each kernel itself (here by
    compiling Inductor's C++ source) and hands it to fxrt through the fused-kernel registry,
    instead of defining it in the wrapper."""

    register_payloads = True
    built: dict[str, CountingKernel] = {}

    def define_kernel(self, kernel_name, kernel_body, metadata=None, gpu=True, cpp_definition=None):
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.codecache import CodeCacheFuture

        fn = eval(kernel_body, {"async_compile": AsyncCompile()})
        if isinstance(fn, CodeCacheFuture):
            fn = fn.result()
        if self.register_payloads:
            kernel = type(self).built[kernel_name] = CountingKernel(fn)
            fxrt.register_fused_kernel(kernel_name, kernel)


@pytest.fixture
def fused_library(monkeypatch):
    fxrt.register_fx_wrapper()
    for device in ("cpu",):
        entry = inductor_common.device_codegens[device]
        monkeypatch.setitem(
            inductor_common.device_codegens,
            device,
            type(entry)(
                entry.scheduling,
                entry.wrapper_codegen,
                entry.cpp_wrapper_codegen,
                FusedLibraryWrapper,
            ),
        )
    yield FusedLibraryWrapper
    for name in FusedLibraryWrapper.built:
        fxrt.inductor.unregister_fused_kernel(name)
    FusedLibraryWrapper.built.clear()


def test_fused_kernel_registry():
    assert fxrt.get_fused_kernel_payload("fxrt_test_nope") is None
    fxrt.register_fused_kernel("fxrt_test_k", {"json": 1})
    try:
        assert fxrt.get_fused_kernel_payload("fxrt_test_k") == {"json": 1}
        fxrt.register_fused_kernel("fxrt_test_k", b"v2")  # registering again replaces
        assert fxrt.get_fused_kernel_payload("fxrt_test_k") == b"v2"
    finally:
        fxrt.inductor.unregister_fused_kernel("fxrt_test_k")
    assert fxrt.get_fused_kernel_payload("fxrt_test_k") is None
    with pytest.raises(TypeError):
        fxrt.register_fused_kernel("", 1)


def test_fused_kernels_from_a_device_library_run_in_fxrt(fused_library):
    def fn(x, y):
        return torch.sigmoid(x @ y + 1.0) * 2.0

    x, y = torch.randn(4, 8), torch.randn(8, 3)
    # No definition and no payload: a clear error instead of a wrong graph.
    fused_library.register_payloads = False
    with pytest.raises(Exception, match="no runnable definition"):
        torch.compile(fresh_entry(fn, "fused-undefined"))(x, y)
    fused_library.register_payloads = True
    before = {id(cg) for cg in compiled_host_graphs()}
    compiled_fn = torch.compile(fresh_entry(fn, "fused"))
    with capturing_modules() as mods:
        torch.testing.assert_close(compiled_fn(x, y), fn(x, y))
    (cg,) = [g for g in compiled_host_graphs() if id(g) not in before]
    assert fused_library.built
    # The host graph's kernel calls carry the library's payloads for graph passes to read.
    payloads = {
        n.meta["fxrt_kernel"]: n.meta["fxrt_fused_payload"]
        for n in mods[0].gm.graph.nodes
        if "fxrt_fused_payload" in n.meta
    }
    assert payloads == fused_library.built
    kernels = [cg.program.nodes[i.node].name for i in cg.program.code if isinstance(i, PyCall)]
    assert sorted(kernels) == sorted(fused_library.built)
    assert all(k.calls == 1 for k in fused_library.built.values())
    compiled_fn(x, y)
    assert all(k.calls == 2 for k in fused_library.built.values())


# --- a wrapper fxrt cannot run: Inductor's own wrapper for that graph --------------------------


class PlainLineWrapper(FxrtWrapperCodegen):
    """Writes a plain source line among the wrapper lines, as some of Inductor's codegen paths
    do (OPT's forward wrote comment lines): Inductor's Python wrapper takes any such line, its FX
    converter rejects it ("Found line of unrecognized type")."""

    def _generate(self, is_inference):
        self.lines.insert(0, "pass  # a plain source line")
        return super()._generate(is_inference)


def _fails_to_compile(gm, config):
    raise RuntimeError("fxrt cannot compile this host graph")


@pytest.mark.wrapper_fallback
@pytest.mark.parametrize("cause", ["unknown wrapper line", "fxrt compile error"])
def test_graph_fxrt_cannot_run_falls_back_to_inductors_wrapper(cause, monkeypatch, caplog):
    from fxrt.inductor import fx_wrapper

    fxrt.register_fx_wrapper()
    if cause == "unknown wrapper line":
        entry = inductor_common.device_codegens["cpu"]
        monkeypatch.setitem(
            inductor_common.device_codegens,
            "cpu",
            dataclasses.replace(entry, fx_wrapper_codegen=PlainLineWrapper),
        )
        expected_reason = "unrecognized type"
    else:
        monkeypatch.setattr(fx_wrapper, "compile_host_graph", _fails_to_compile)
        expected_reason = "fxrt cannot compile this host graph"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32)).eval()
    fallbacks = fxrt.inductor.stats["python_wrapper_fallbacks"]
    before = {id(cg) for cg in compiled_host_graphs()}
    fn = torch.compile(fresh_entry(model, f"fallback-{cause}"))
    with caplog.at_level("WARNING", logger="fxrt"), capturing_modules() as mods:
        with torch.inference_mode():
            for _ in range(2):  # fresh inputs each call: results are eager's every time
                x = torch.randn(3, 16)
                torch.testing.assert_close(fn(x), model(x))
    # Inductor's own Python wrapper module, no fxrt host graph, one log line, never an error.
    assert len(mods) == 1 and isinstance(mods[0], types.ModuleType)
    assert not [g for g in compiled_host_graphs() if id(g) not in before]
    assert fxrt.inductor.stats["python_wrapper_fallbacks"] == fallbacks + 1
    lines = [r.getMessage() for r in caplog.records if r.name == "fxrt"]
    assert len(lines) == 1, lines
    assert "Inductor's own Python wrapper" in lines[0] and expected_reason in lines[0]


@pytest.mark.wrapper_fallback
def test_fallback_handles_symbolic_sizes(monkeypatch):
    # The Python wrapper binds input sizes in its prologue, which the FX path never reads.
    fxrt.register_fx_wrapper()
    entry = inductor_common.device_codegens["cpu"]
    monkeypatch.setitem(
        inductor_common.device_codegens,
        "cpu",
        dataclasses.replace(entry, fx_wrapper_codegen=PlainLineWrapper),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32)).eval()
    fn = torch.compile(fresh_entry(model, "fallback-dynamic"), dynamic=True)
    with torch.inference_mode():
        for rows in (2, 5, 7):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(fn(x), model(x))


# --- CUDA: Triton kernels through the same path ------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)")
@pytest.mark.parametrize("executor", EXECUTORS)
def test_cuda_triton_kernels_run_in_fxrt(executor):
    skip_unless_executor(executor)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64)).cuda().eval()
    x = torch.randn(4, 32, device="cuda")
    before = {id(cg) for cg in compiled_host_graphs()}
    with registered(fxrt.CompilerConfig(pure_python=executor == "python")):
        fn = torch.compile(fresh_entry(model, f"cuda-{executor}"))
        with torch.inference_mode():
            got = fn(x)
    with torch.inference_mode():
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)
    (cg,) = [g for g in compiled_host_graphs() if id(g) not in before]
    assert cg.executor == executor
    assert "higher_order.triton_kernel_wrapper_mutation" in str(cg.program)
