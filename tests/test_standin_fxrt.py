"""fxrt on the stand-in accelerator (tests/standin): the model tests and a slice of the OpInfo
sweep run on the device on both loops and must equal eager on the CPU; the arena lives in
device memory and a steady call allocates nothing it covers; a compiled graph runs on the
caller's current stream.

Every compiled function is called at least twice, on different inputs, and results are read
back to the host (which waits for the stream) before they are compared with
``torch.testing.assert_close``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import standin
import torch
import torch._dynamo
from conftest import recording_compiles, skip_unless_executor
from test_models import ConvNet, WithConstants
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_map

import fxrt
from fxrt.models import MLP, DecoderBlock, OpChain


@pytest.fixture(autouse=True)
def _idle_device(request):
    yield
    if "dev" in request.fixturenames:
        request.getfixturevalue("dev").synchronize()


def to_device(x: Any) -> Any:
    name = standin.name()
    return tree_map(lambda t: t.to(name) if isinstance(t, torch.Tensor) else t, x)


def to_cpu(x: Any) -> Any:
    return tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, x)


def compiled_on_device(fn: Callable, executor: str, **options: Any) -> Callable:
    """``torch.compile(fn, backend="fxrt")`` on ``executor`` (skips without the compiled loop)."""
    skip_unless_executor(executor)
    torch._dynamo.reset()
    opts = {"pure_python": executor == "python", "cache": False, **options}
    return torch.compile(fn, backend="fxrt", options=opts)


def check_model(model: torch.nn.Module | Callable, calls: list[tuple], executor: str) -> None:
    """Eager on the CPU vs fxrt on the device, call after call (each with its own inputs);
    outputs, inputs after the call (mutations) and the module's state must match."""
    eager = copy.deepcopy(model)
    on_device = copy.deepcopy(model)
    if isinstance(on_device, torch.nn.Module):
        on_device = on_device.to(standin.name())
        for m in on_device.modules():  # plain tensor attributes too (WithConstants.scale)
            for k, v in list(vars(m).items()):
                if isinstance(v, torch.Tensor):
                    setattr(m, k, v.to(standin.name()))
    compiled = compiled_on_device(on_device, executor)
    with recording_compiles() as built:
        for inputs in calls:
            want_inputs = copy.deepcopy(inputs)
            want = eager(*want_inputs)
            dev_inputs = to_device(inputs)
            got = compiled(*dev_inputs)
            torch.testing.assert_close(to_cpu(got), want)
            torch.testing.assert_close(to_cpu(dev_inputs), want_inputs)
    assert built and {cg.executor for cg in built} == {executor}
    if isinstance(model, torch.nn.Module):
        torch.testing.assert_close(to_cpu(dict(on_device.state_dict())), dict(eager.state_dict()))


# --- the model tests, on the device ------------------------------------------------------------


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
def test_mlp(dev, executor, grad_mode):
    torch.manual_seed(0)
    ctx = torch.inference_mode if grad_mode == "inference_mode" else torch.no_grad
    with ctx():
        check_model(MLP(64, 3).eval(), [(torch.randn(2, 64),), (torch.randn(2, 64),)], executor)


def test_convnet_eval(dev, executor):
    torch.manual_seed(0)
    model = ConvNet().eval()
    with torch.no_grad():
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
        check_model(model, [(torch.randn(2, 3, 16, 16),), (torch.randn(2, 3, 16, 16),)], executor)


def test_convnet_train_mode_updates_running_stats(dev, executor):
    torch.manual_seed(0)
    check_model(ConvNet().train(), [(torch.randn(4, 3, 16, 16),) for _ in range(2)], executor)


def test_op_chain(dev, executor):
    with torch.no_grad():
        check_model(OpChain(40), [(torch.randn(1, 64),), (torch.randn(1, 64),)], executor)


def test_decoder_block(dev, executor):
    torch.manual_seed(0)
    with torch.no_grad():
        calls = [(torch.randn(2, 8, 64),), (torch.randn(2, 8, 64),)]
        check_model(DecoderBlock(64, 4).eval(), calls, executor)


def test_decoder_block_kv_cache(dev, executor):
    """Three decode steps; the KV cache (device buffers) is updated in place each step."""
    torch.manual_seed(0)
    steps = [(torch.randn(1, 4, 64), torch.arange(4 * i, 4 * i + 4)) for i in range(3)]
    with torch.no_grad():
        check_model(DecoderBlock(64, 4, cache_len=16).eval(), steps, executor)


def test_constants_captured_as_attributes(dev, executor):
    torch.manual_seed(0)
    with torch.no_grad():
        check_model(WithConstants().eval(), [(torch.randn(3, 8),), (torch.randn(3, 8),)], executor)


def test_outputs_that_are_views_of_inputs(dev, executor):
    def f(x, y):
        return x.t(), x[1:], y.view(-1), x + 1

    check_model(f, [(torch.randn(4, 3), torch.randn(2, 3)) for _ in range(2)], executor)
    compiled = compiled_on_device(f, executor)
    x, y = to_device((torch.randn(4, 3), torch.randn(2, 3)))
    out = compiled(x, y)
    assert out[0]._base is x and out[1]._base is x and out[2]._base is y
    assert out[0].data_ptr() == x.data_ptr()
    x.add_(1)  # the views see writes to their base, as in eager
    torch.testing.assert_close(out[0].cpu(), x.t().cpu())


def test_input_mutation_and_inplace_intermediates(dev, executor):
    def f(cache, x, idx):
        cache.index_copy_(0, idx, x)
        buf = cache[:2]
        buf.mul_(2)
        y = x * 3
        y.relu_()
        return cache.sum(dim=0), y

    calls = [(torch.zeros(6, 4), torch.randn(2, 4), torch.tensor([1, 4])) for _ in range(2)]
    check_model(f, calls, executor)


def test_multiple_tuple_and_none_outputs(dev, executor):
    def f(x):
        v, i = x.max(dim=1)
        return (v, None, (i, x.sum()), [x.mean()])

    check_model(f, [(torch.randn(5, 7),), (torch.randn(5, 7),)], executor)


def test_autograd_forward_and_backward(dev, executor):
    torch.manual_seed(0)
    model = MLP(32, 2)
    x = torch.randn(4, 32)
    ref_model, ref_x = copy.deepcopy(model), x.clone().requires_grad_()
    ref_model(ref_x).pow(2).sum().backward()
    dmodel = copy.deepcopy(model).to(standin.name())
    dx = x.to(standin.name()).requires_grad_()
    compiled = compiled_on_device(dmodel, executor)
    # Autograd's engine sizes its per-device threads once, at the process's first backward; the
    # stand-in, loaded later in a test session, has none: backward runs on the calling thread.
    with recording_compiles() as built, torch.autograd.set_multithreading_enabled(False):
        compiled(dx).pow(2).sum().backward()
    assert len(built) == 2 and {cg.executor for cg in built} == {executor}
    torch.testing.assert_close(dx.grad.cpu(), ref_x.grad)
    for p, rp in zip(dmodel.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad.cpu(), rp.grad)


# --- the arena, in device memory ---------------------------------------------------------------


def _chain(x, w):
    y = torch.relu(x @ w)
    z = (y * 2 + 1).sin()
    return (z @ w).sum(0)


def test_arena_lives_in_device_memory(dev, executor):
    skip_unless_executor(executor)
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    dx, dw = to_device((x, w))
    cg = fxrt.compile_graph(
        make_fx(_chain)(dx, dw),
        [dx, dw],
        fxrt.CompilerConfig(pure_python=executor == "python", cache=False),
    )
    arena = cg.program.arena
    assert arena is not None and arena.slots, "no arena for a graph on the device"
    assert arena.device == f"{standin.name()}:0"
    on_cpu = fxrt.compile_graph(make_fx(_chain)(x, w), [x, w], fxrt.CompilerConfig(cache=False))
    assert [s.nbytes for s in arena.slots] == [s.nbytes for s in on_cpu.program.arena.slots]
    tensors = arena.allocate()
    assert {t.device for t in tensors} == {torch.device(standin.name(), 0)}
    for _ in range(2):
        x, w = torch.randn(8, 16), torch.randn(16, 16)
        torch.testing.assert_close(cg(*to_device((x, w))).cpu(), _chain(x, w))


def test_steady_calls_allocate_only_their_results(dev, executor):
    """Once the arena exists, a call allocates only what it returns; a graph that returns
    nothing fresh (it writes its result into an input) allocates nothing at all."""
    skip_unless_executor(executor)

    def into(out, x, w):
        out.copy_(_chain(x, w))

    cfg = fxrt.CompilerConfig(pure_python=executor == "python", cache=False)
    x, w = to_device((torch.randn(8, 16), torch.randn(16, 16)))
    out = torch.empty(16, device=standin.name())
    for fn, args, fresh in ((_chain, (x, w), 1), (into, (out, x, w), 0)):
        cg = fxrt.compile_graph(make_fx(fn)(*args), list(args), cfg)
        assert cg.program.arena is not None and cg.program.arena.slots
        cg(*args)  # the first call makes the arena
        dev.synchronize()
        before = dev.allocation_count()
        for _ in range(3):
            result = cg(*args)
        assert dev.allocation_count() - before == 3 * fresh, cg.program
        del result
    torch.testing.assert_close(out.cpu(), _chain(x.cpu(), w.cpu()))


def test_memory_is_freed_by_the_end(dev, executor):
    skip_unless_executor(executor)
    dev.synchronize()
    baseline = dev.memory_allocated()
    x, w = to_device((torch.randn(8, 16), torch.randn(16, 16)))
    cfg = fxrt.CompilerConfig(pure_python=executor == "python", cache=False)
    cg = fxrt.compile_graph(make_fx(_chain)(x, w), [x, w], cfg)
    for _ in range(2):
        cg(x, w)
    cg.release_memory()
    del cg, x, w
    dev.synchronize()
    assert dev.memory_allocated() == baseline


# --- streams ----------------------------------------------------------------------------------


def test_runs_on_the_current_stream(dev, executor):
    """A graph called under a side stream enqueues its work there: with that stream lagging,
    its results are right once the stream is waited for, and the default stream got nothing."""
    side = dev.Stream()
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    dx, dw = to_device((x, w))
    compiled = compiled_on_device(_chain, executor)
    compiled(dx, dw)  # compile first, off the side stream
    side.wait_stream(dev.current_stream())
    main_tasks = dev.stream_tasks(dev.current_stream())[0]
    with dev.delay(50_000, side), dev.stream(side):
        got = compiled(dx, dw)
        assert not side.query()
        side.synchronize()
    assert dev.stream_tasks(dev.current_stream())[0] == main_tasks
    torch.testing.assert_close(got.cpu(), _chain(x, w))


def test_calls_on_two_streams_in_turn(dev, executor):
    """Eager semantics: each call's fresh memory belongs to the stream it runs on, so calls on
    two streams, with no synchronization between them, never share memory. Both streams lag
    (100 ms a task), the second call starting 50 ms after the first, so their tasks interleave."""
    side, main = dev.Stream(), dev.current_stream()
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    x2 = torch.randn(8, 16)
    dx, dw, dx2 = to_device((x, w, x2))
    compiled = compiled_on_device(_chain, executor)
    with recording_compiles() as built:
        compiled(dx, dw)
    assert all(cg.program.arena is not None for cg in built)
    dev.synchronize()
    with dev.delay(100_000), dev.delay(100_000, main):
        side.wait_stream(main)
        with dev.stream(side):
            a = compiled(dx, dw)
        time.sleep(0.05)
        b = compiled(dx2, dw)  # the default stream, with the arena the first call gave back
        main.wait_stream(side)
        got_a, got_b = a.cpu(), b.cpu()
    torch.testing.assert_close(got_b, _chain(x2, w))
    torch.testing.assert_close(got_a, _chain(x, w))


# --- a slice of the OpInfo sweep, on the device ----------------------------------------------

_F, _I, _O = ("function",), ("function", "inplace"), ("function", "out")
OPINFO_SLICE: dict[str, tuple[str, ...]] = {
    "add": ("function", "inplace", "out"),
    "sigmoid": _I,
    "frexp": _F,
    "where": _F,
    "sum": _F,
    "mean": _O,
    "max.reduction_with_dim": _O,
    "var_mean": _F,
    "permute": _F,
    "as_strided": _F,
    "__getitem__": _F,
    "unsqueeze": _I,
    "split": _F,
    "index_select": _F,
    "index_put": _F,
    "scatter": _F,
    "mm": _O,
    "nn.functional.conv2d": _F,
    "native_layer_norm": _F,
    "softmax": _F,
    "cat": _O,
    "sort": _O,
    "item": _F,
    "fill": _I,
}
OPINFO_CASES = [(op, v) for op, vs in OPINFO_SLICE.items() for v in vs]


def _to_device_keeping_storage(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device copies with the same sizes, strides, offsets and storage sharing."""
    name = standin.name()
    storages: dict[int, torch.UntypedStorage] = {}
    out = []
    for t in tensors:
        if t.layout != torch.strided or t.is_conj() or t.is_neg():
            out.append(t.to(name))
            continue
        s = t.untyped_storage()
        key = s.data_ptr() if s.nbytes() else id(t)
        if key not in storages:
            raw = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),), (1,))
            storages[key] = raw.to(name).untyped_storage()
        c = torch.empty(0, dtype=t.dtype, device=name)
        c.set_(storages[key], t.storage_offset(), t.size(), t.stride())
        out.append(c)
    return out


@pytest.mark.parametrize(("op_name", "variant"), OPINFO_CASES)
def test_opinfo_slice(dev, executor, op_name, variant):
    import test_opinfo as sweep

    skip_unless_executor(executor)
    op = sweep._OPS[op_name]
    tol = sweep._tolerances(op)
    compared = 0
    for sample in sweep._samples(op):
        if compared == 2:
            break
        out_like = None
        if variant == "out":
            try:
                ref = sweep._make_case(op, "function", sample).fn(
                    *sweep._copy_tensors(sweep._tensors_of(sample))
                )
            except Exception:
                continue
            out_like = sweep._out_buffers(ref)
            if out_like is None:
                continue
        case = sweep._make_case(op, variant, sample, out_like)
        try:
            wants = [sweep._run(case), sweep._run(case, perturb=True)]
        except Exception:  # not a valid sample for this variant in eager
            continue
        compared += 1
        compiled = compiled_on_device(case.fn, executor)
        first = None
        with recording_compiles() as built:
            for perturb, (want_result, want_args) in zip((False, True), wants):
                args = _to_device_keeping_storage(sweep._copy_tensors(case.tensors, perturb))
                result = compiled(*args)
                sweep.assert_same(to_cpu(result), want_result, *tol, "result")
                sweep.assert_same([a.cpu() for a in args], want_args, *tol, "args after the call")
                assert sweep.alias_pattern(result, args) == sweep.alias_pattern(
                    want_result, want_args
                )
                assert sweep._strides(result) == sweep._strides(want_result)
                if first is None:
                    first = (result, to_cpu(result))
        # the second call left the first call's result as it was
        sweep.assert_same(to_cpu(first[0]), first[1], 0.0, 0.0, "first result after the second")
        assert {cg.executor for cg in built} <= {executor}
    assert compared, "no sample ran in eager"


@pytest.mark.parametrize("pure_python", [False, True], ids=["cpp", "python"])
def test_deploy_package_loads_onto_the_device(dev, tmp_path, pure_python):
    # fxrt.load(path, device="fxrt_standin"): the weights move there and the graph runs there; the
    # bare device name means the current device, as for "cuda".
    torch.manual_seed(0)
    model = MLP(64, 2).eval()
    x = torch.randn(4, 64)
    path = tmp_path / "mlp.fxrt"
    fxrt.export(model, (x,)).save(path)
    loaded = fxrt.load(path, device="fxrt_standin", options={"pure_python": pure_python})
    for inp in (x, torch.randn(4, 64)):
        out = loaded(inp.to("fxrt_standin"))
        assert out.device.type == "fxrt_standin"
        torch.testing.assert_close(out.cpu(), model(inp))
    with pytest.raises(fxrt.InputError, match="device"):
        loaded(x)  # a CPU input is named, not run on the wrong device
