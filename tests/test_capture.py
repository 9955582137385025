"""Whole-graph capture (``mode="reduce-overhead"``) on the stand-in accelerator, both loops.

Every test compares with eager on the CPU, call after call with different inputs, and reads the
results back to the host. A replay is shown to be one host launch by the stand-in's launch
counter; what is not captured is shown by ``capture_report()`` naming the node or input.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import pytest
import standin
import torch
import torch._dynamo
from conftest import recording_compiles, run_in_threads, skip_unless_executor
from test_standin_fxrt import _idle_device, to_cpu, to_device  # noqa: F401 - the fixture too
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.models import MLP, DecoderBlock, KVCacheDecoder


def compiled(fn: Callable, executor: str, dynamic: bool | None = None, **options: Any) -> Callable:
    skip_unless_executor(executor)
    torch._dynamo.reset()
    opts = {"pure_python": executor == "python", "cache": False, "capture": True, **options}
    return torch.compile(fn, backend="fxrt", dynamic=dynamic, options=opts)


def launches(dev) -> int:
    return dev.launches(dev.current_stream())


def only_graph(built: list[fxrt.CompiledGraph]) -> fxrt.CompiledGraph:
    assert len(built) == 1, [cg.name for cg in built]
    return built[0]


def check_calls(
    model: torch.nn.Module,
    calls: list[tuple],
    executor: str,
    dynamic: bool | None = None,
    **options,
):
    """Eager on the CPU vs capture on the device, call after call; returns the compiled graph."""
    eager = copy.deepcopy(model)
    on_device = copy.deepcopy(model).to(standin.name())
    f = compiled(on_device, executor, dynamic, **options)
    results = []
    with recording_compiles() as built, torch.no_grad():
        for inputs in calls:
            want = eager(*inputs)
            results.append((f(*to_device(inputs)), want))
    for got, want in results:  # earlier outputs are intact after later replays
        torch.testing.assert_close(to_cpu(got), want)
    torch.testing.assert_close(to_cpu(dict(on_device.state_dict())), dict(eager.state_dict()))
    return only_graph(built)


def test_mlp_replays_and_equals_eager(dev, executor):
    torch.manual_seed(0)
    calls = [(torch.randn(2, 64),) for _ in range(5)]
    cg = check_calls(MLP(64, 3).eval(), calls, executor)
    report = cg.capture_report()
    [sig] = report.signatures
    assert sig.captured and sig.captures == 1, str(report)
    assert sig.replays == 4 and sig.loop_calls == 1, str(report)  # one warmup, then replays


def test_decoder_block_replays(dev, executor):
    torch.manual_seed(0)
    calls = [(torch.randn(1, 8, 64),) for _ in range(4)]
    cg = check_calls(DecoderBlock(64, 4).eval(), calls, executor, capture_warmup=2)
    [sig] = cg.capture_report().signatures
    assert sig.captured and sig.replays == 2 and sig.loop_calls == 2


def test_decoder_with_kv_cache_buffers_over_many_steps(dev, executor):
    """The block's KV cache buffers are written in place each step: they are read where they lie
    (fixed inputs), and the state after every step equals eager's."""
    torch.manual_seed(0)
    steps = [(torch.randn(1, 1, 64), torch.tensor([i])) for i in range(12)]
    cg = check_calls(DecoderBlock(64, 4, cache_len=16).eval(), steps, executor)
    [sig] = cg.capture_report().signatures
    assert sig.captured and sig.replays == 11, str(cg.capture_report())


def test_replay_is_one_host_launch(dev, executor):
    torch.manual_seed(0)
    model = MLP(64, 3).eval()
    f = compiled(copy.deepcopy(model).to(standin.name()), executor, clone_output=False)
    x = to_device(torch.randn(2, 64))
    with recording_compiles() as built, torch.no_grad():
        before = launches(dev)
        f(x)  # warmup: the loop, one launch per op
        loop_launches = launches(dev) - before
        f(x)  # capture (nothing runs), then one replay
        for _ in range(3):
            x.copy_(torch.randn(2, 64))  # same address: the input is read where it lies
            want = model(x.cpu())
            before = launches(dev)
            y = f(x)
            assert launches(dev) - before == 1
            torch.testing.assert_close(y.cpu(), want)
    cg = only_graph(built)
    assert loop_launches >= len([i for i in cg.program.code if i.KIND != "FREE"]) // 2
    assert loop_launches >= 9  # three Linear, GELU, LayerNorm


def test_default_replay_launches_copy_replay_and_clone(dev, executor):
    """With the defaults, a call with a new input is: copy it in, replay, clone the output."""
    torch.manual_seed(0)
    model = MLP(64, 3).eval()
    f = compiled(copy.deepcopy(model).to(standin.name()), executor)
    with torch.no_grad():
        for _ in range(2):
            f(to_device(torch.randn(2, 64)))
        x = to_device(torch.randn(2, 64))
        before = launches(dev)
        y = f(x)
        assert launches(dev) - before == 3
        torch.testing.assert_close(y.cpu(), model(x.cpu()))


def test_without_clone_output_the_next_call_overwrites(dev, executor):
    torch.manual_seed(0)
    model = MLP(64, 2).eval()
    f = compiled(copy.deepcopy(model).to(standin.name()), executor, clone_output=False)
    xs = [torch.randn(2, 64) for _ in range(4)]
    with torch.no_grad():
        f(to_device(xs[0]))
        y1 = f(to_device(xs[1]))
        torch.testing.assert_close(y1.cpu(), model(xs[1]))
        y2 = f(to_device(xs[2]))
        # The documented rule: y1 is the pool's memory, which the next replay wrote.
        assert y1.data_ptr() == y2.data_ptr()
        torch.testing.assert_close(y1.cpu(), model(xs[2]))
    f = compiled(copy.deepcopy(model).to(standin.name()), executor)  # clone_output on
    with torch.no_grad():
        f(to_device(xs[0]))
        y1 = f(to_device(xs[1]))
        y2 = f(to_device(xs[2]))
        assert y1.data_ptr() != y2.data_ptr()
        torch.testing.assert_close(y1.cpu(), model(xs[1]))
        torch.testing.assert_close(y2.cpu(), model(xs[2]))


def test_outputs_aliasing_inputs_and_each_other(dev, executor):
    """Aliasing as in eager: an output that is a view of an input views the caller's tensor; two
    outputs that share a storage still share it after the clone."""

    def f(x, y):
        z = x * 2 + y
        return x[0], z, z.view(-1)

    g = compiled(f, executor)
    for _ in range(3):
        x, y = to_device(torch.randn(3, 4)), to_device(torch.randn(3, 4))
        a, z, flat = g(x, y)
        assert a.data_ptr() == x.data_ptr()
        assert flat.data_ptr() == z.data_ptr()
        torch.testing.assert_close(z.cpu(), x.cpu() * 2 + y.cpu())
        torch.testing.assert_close(a.cpu(), x.cpu()[0])


def test_kv_cache_address_change_recaptures(dev, executor, caplog):
    """Caches passed in and written in place: a new cache (another address) recaptures, counted
    and logged, and values stay right."""
    torch.manual_seed(0)
    model = KVCacheDecoder().eval()
    f = compiled(copy.deepcopy(model).to(standin.name()), executor)
    with recording_compiles() as built, torch.no_grad(), caplog.at_level(logging.INFO, "fxrt"):
        for _ in range(2):
            k, v = model.empty_cache(1, 8)
            dk, dv = to_device((k, v))
            for step in range(4):
                x, pos = torch.randn(1, 1, 32), torch.tensor([step])
                want = model(x, k, v, pos)
                got = f(*to_device((x,)), dk, dv, to_device(pos))
                torch.testing.assert_close(got.cpu(), want)
                torch.testing.assert_close(dk.cpu(), k)
                torch.testing.assert_close(dv.cpu(), v)
    [sig] = only_graph(built).capture_report().signatures
    assert sig.captured and sig.captures == 2, str(sig)
    assert "changed address; recapturing" in caplog.text


def test_capture_limit_then_the_loop(dev, executor, caplog):
    torch.manual_seed(0)
    model = MLP(32, 2).eval()
    sizes = [2, 3, 2, 3, 4, 4, 2]
    calls = [(torch.randn(n, 32),) for n in sizes for _ in range(2)]
    with caplog.at_level(logging.WARNING, "fxrt"):
        cg = check_calls(model, calls, executor, dynamic=True, capture_limit=2)
    report = cg.capture_report()
    assert "capture_limit=2" in report.reason, str(report)
    assert report.captured == 0  # past the limit the captures are released
    assert "runs op by op from now on" in caplog.text


def test_dynamic_shapes_capture_per_size(dev, executor):
    torch.manual_seed(0)
    calls = [(torch.randn(n, 32),) for n in (2, 3, 2, 3, 2, 3)]
    cg = check_calls(MLP(32, 2).eval(), calls, executor, dynamic=True)
    report = cg.capture_report()
    assert [s.captured for s in report.signatures] == [True, True], str(report)
    assert sum(s.replays for s in report.signatures) == 4


def test_threads_share_one_captured_graph(dev, executor):
    """Eight threads call one compiled graph with inputs of their own, some of a second size
    (its own signature): every result is eager's, and the calls replay."""
    torch.manual_seed(0)
    model = MLP(32, 2).eval()
    f = compiled(copy.deepcopy(model).to(standin.name()), executor, dynamic=True)
    with recording_compiles() as built, torch.no_grad():
        f(to_device(torch.randn(2, 32)))  # compiles before the threads start

        def work(seed: int) -> None:
            gen = torch.Generator().manual_seed(seed)
            for step in range(6):
                x = torch.randn(2 + (seed + step) % 2, 32, generator=gen)
                with torch.no_grad():  # grad mode is per thread
                    got = to_cpu(f(to_device(x)))
                    torch.testing.assert_close(got, model(x))

        run_in_threads(work)
    report = only_graph(built).capture_report()
    assert [s.captured for s in report.signatures] == [True, True], str(report)
    assert sum(s.replays for s in report.signatures) > 30, str(report)


def _graph(fn: Callable, *inputs: Any) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="symbolic")(*inputs)


@pytest.mark.parametrize(
    ("fn", "expect"),
    [
        (lambda x: x * x.sum().item(), "_local_scalar_dense"),
        (lambda x: x.nonzero().float().sum() + x, "nonzero"),
        (lambda x: (x + 1).cpu() * 2, "makes a CPU tensor"),
    ],
    ids=["item", "nonzero", "cpu"],
)
def test_uncapturable_node_runs_on_the_loop_and_is_named(dev, executor, fn, expect):
    skip_unless_executor(executor)
    x = torch.randn(4, 4)
    config = fxrt.CompilerConfig(pure_python=executor == "python", cache=False, capture=True)
    cg = fxrt.compile_graph(_graph(fn, to_device(x)), [to_device(x)], config)
    for _ in range(3):
        x = torch.randn(4, 4)
        torch.testing.assert_close(to_cpu(cg(to_device(x))), fn(x))
    report = cg.capture_report()
    assert report.regions, str(report)  # captured around the node that cannot be
    loop = [r for _, r in report.regions if isinstance(r, str)]
    assert loop and expect in loop[0] and loop[0].startswith("node "), str(report)


def test_regions_around_a_host_read_are_captured(dev, executor):
    """A host read in the middle of a graph: the regions before and after it are captured and
    replayed, the read runs on the loop, and the values equal eager's on every call."""
    skip_unless_executor(executor)
    torch.manual_seed(0)
    w1, w2 = torch.randn(16, 16), torch.randn(16, 16)

    def fn(x, w1, w2):
        a = (x @ w1).relu()
        n = a.sum().item()  # read on the host
        b = (a @ w2).sigmoid() * 3
        return b, a.mean() + n

    x = torch.randn(4, 16)
    args = to_device((x, w1, w2))
    config = fxrt.CompilerConfig(pure_python=executor == "python", cache=False, capture=True)
    cg = fxrt.compile_graph(_graph(fn, *args), list(args), config)
    got = []
    for _ in range(4):
        x = torch.randn(4, 16)
        got.append((cg(*to_device((x, w1, w2))), fn(x, w1, w2)))
    for g, want in got:
        torch.testing.assert_close(to_cpu(g), want)
    report = cg.capture_report()
    text = str(report)
    kinds = [isinstance(r, str) for _, r in report.regions]
    assert kinds.count(True) >= 1 and kinds.count(False) >= 2, text
    assert "_local_scalar_dense" in text, text
    first = report.regions[0][1]
    assert first.captured == 1 and first.signatures[0].replays >= 2, text


def test_cpu_mode_reduce_overhead_runs_the_loop(executor):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP(32, 2).eval()
    f = torch.compile(
        model,
        backend="fxrt",
        mode="reduce-overhead",
    )
    with recording_compiles() as built, torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 32)
            torch.testing.assert_close(f(x), model(x))
    report = only_graph(built).capture_report()
    assert report.enabled and report.captured == 0
    assert "CPU" in report.reason


def test_force_eager_and_capture_off(dev, executor):
    torch.manual_seed(0)
    calls = [(torch.randn(2, 32),) for _ in range(3)]
    cg = check_calls(MLP(32, 2).eval(), calls, executor, force_eager=True)
    assert cg.capture_report().captured == 0 and "force_eager" in cg.capture_report().reason
    cg = check_calls(MLP(32, 2).eval(), calls, executor, capture=False)
    assert not cg.capture_report().enabled


def test_clone_input_off_reads_inputs_in_place(dev, executor):
    """Without clone_input nothing is copied; a new input address recaptures."""
    torch.manual_seed(0)
    calls = [(torch.randn(2, 32),) for _ in range(4)]
    cg = check_calls(MLP(32, 2).eval(), calls, executor, clone_input=False)
    [sig] = cg.capture_report().signatures
    assert sig.copied_inputs == () and sig.captures >= 1


def test_shared_graph_pool_and_release_memory(dev, executor):
    torch.manual_seed(0)
    pool = dev.graph_pool_handle()
    m1, m2 = MLP(32, 2).eval(), MLP(32, 2).eval()
    f1 = compiled(copy.deepcopy(m1).to(standin.name()), executor, use_graph_pool=pool)
    with recording_compiles() as built, torch.no_grad():
        f2 = torch.compile(
            copy.deepcopy(m2).to(standin.name()),
            backend="fxrt",
            options={
                "pure_python": executor == "python",
                "cache": False,
                "capture": True,
                "use_graph_pool": pool,
            },
        )
        for _ in range(3):
            x = torch.randn(2, 32)
            y1, y2 = f1(to_device(x)), f2(to_device(x))
            torch.testing.assert_close(y1.cpu(), m1(x))
            torch.testing.assert_close(y2.cpu(), m2(x))
    for cg in built:
        assert cg.capture_report().captured == 1
        cg.release_memory()
        assert cg.capture_report().captured == 0
    with torch.no_grad():  # captures again after release
        x = torch.randn(2, 32)
        for _ in range(2):
            torch.testing.assert_close(f1(to_device(x)).cpu(), m1(x))


def test_training_step_equals_eager(dev, executor):
    """Under autograd, AOTAutograd calls the forward and backward graphs without grad: both are
    captured (the outputs the backward saves are clones), and gradients equal eager's."""
    torch.manual_seed(0)

    def fn(x, w):
        return (x @ w).relu().sum()

    g = compiled(fn, executor)
    w_cpu = torch.randn(4, 4, requires_grad=True)
    w = w_cpu.detach().to(standin.name()).requires_grad_()
    with recording_compiles() as built:
        for _ in range(4):
            x = torch.randn(2, 4)
            w.grad = w_cpu.grad = None
            g(to_device(x), w).backward()
            fn(x, w_cpu).backward()
            torch.testing.assert_close(w.grad.cpu(), w_cpu.grad)
    reports = [cg.capture_report() for cg in built]
    assert len(reports) == 2, [str(r) for r in reports]
    assert all(r.captured == 1 for r in reports), [str(r) for r in reports]


def test_bad_input_is_named_before_any_capture(dev, executor):
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    config = fxrt.CompilerConfig(pure_python=executor == "python", cache=False, capture=True)
    x = to_device(x)
    cg = fxrt.compile_graph(_graph(lambda t: t * 2, x), [x], config)
    with pytest.raises(fxrt.InputError):
        cg(to_device(torch.randn(2, 8, dtype=torch.float64)))
    for _ in range(3):
        x = torch.randn(2, 8)
        torch.testing.assert_close(cg(to_device(x)).cpu(), x * 2)
    assert cg.capture_report().captured == 1


def test_invalid_options_are_named():
    with pytest.raises(ValueError, match="capture_limit"):
        fxrt.CompilerConfig(capture_limit=0)
    with pytest.raises(ValueError, match="capture_warmup"):
        fxrt.CompilerConfig(capture_warmup=-1)
    assert fxrt.CompilerConfig(mode="reduce-overhead").capture_enabled
    assert not fxrt.CompilerConfig(mode="reduce-overhead", capture=False).capture_enabled


def test_a_capture_the_device_refuses_names_the_node(dev, executor, monkeypatch):
    """Past the checks made before capture, the device's own refusal is reported with the error
    of the node that caused it, and the calls run the loop."""
    import fxrt.exec.capture as capture

    monkeypatch.setattr(capture, "node_blockers", lambda graph, program: {})
    skip_unless_executor(executor)

    def fn(x):
        return x.nonzero().float().sum() + x

    x = to_device(torch.randn(4, 4))
    config = fxrt.CompilerConfig(pure_python=executor == "python", cache=False, capture=True)
    cg = fxrt.compile_graph(make_fx(fn)(x), [x], config)
    for _ in range(3):
        x = torch.randn(4, 4)
        torch.testing.assert_close(cg(to_device(x)).cpu(), fn(x))
    [sig] = cg.capture_report().signatures
    assert not sig.captured and "refused" in sig.reason and "nonzero" in sig.reason, sig.reason


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_transformers_decode_steps_replay(dev, executor, name):
    """A tiny ``transformers`` decoder's static-cache generate, forward compiled with capture: the
    tokens equal eager's, and the decode step is captured once and replayed."""
    from clients_child import build, greedy, input_ids

    skip_unless_executor(executor)
    torch._dynamo.reset()
    model = build(name)
    ids = input_ids(1, 5)
    want = greedy(model, ids, 12, cache_implementation="static")
    on_device = copy.deepcopy(model).to(standin.name())
    on_device.forward = torch.compile(
        on_device.forward,
        backend="fxrt",
        dynamic=False,
        options={"pure_python": executor == "python", "cache": False, "capture": True},
    )
    with recording_compiles() as built:
        got = greedy(on_device, to_device(ids), 12, cache_implementation="static")
    assert torch.equal(got.cpu(), want)
    decode = [cg for cg in built if cg.capture_report().captured]
    assert decode, "\n".join(str(cg.capture_report()) for cg in built)
    assert max(s.replays for cg in decode for s in cg.capture_report().signatures) >= 9


_WARM_CHILD = """
import sys, json, torch
sys.path.insert(0, {tests!r})
import standin, fxrt
from fxrt.models import MLP
from conftest import recording_compiles
standin.load()
torch.manual_seed(0)
model = MLP(32, 2).eval()
f = torch.compile(model.to(standin.name()), backend="fxrt", mode="reduce-overhead")
out = []
with recording_compiles() as built, torch.no_grad():
    for i in range(4):
        x = torch.randn(2, 32, generator=torch.Generator().manual_seed(i))
        out.append(f(x.to(standin.name())).cpu().tolist())
[cg] = built
print(json.dumps({{"out": out, "stats": dict(fxrt.cache.stats),
                  "captured": cg.capture_report().captured, "executor": cg.executor}}))
"""


def test_warm_process_replays_a_cache_hit(dev, tmp_path):
    """Two processes on one cache: the second loads the graph from the cache and captures it
    the same way; both equal eager."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    env = {**os.environ, "FXRT_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _WARM_CHILD.format(tests=tests)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    torch.manual_seed(0)
    model = MLP(32, 2).eval()
    with torch.no_grad():
        want = [
            model(torch.randn(2, 32, generator=torch.Generator().manual_seed(i))) for i in range(4)
        ]
    for run in runs:
        assert run["captured"] == 1
        for got, w in zip(run["out"], want):
            torch.testing.assert_close(torch.tensor(got), w)
    assert runs[0]["stats"]["miss"] == 1 and runs[1]["stats"]["hit"] == 1, runs


# --- real devices: run when a GPU or an Ascend NPU is present, skip otherwise -----------------


def _real_device(kind: str) -> str:
    if kind == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return "cuda"
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        pytest.skip("torch_npu is not installed")
    import torch_npu  # noqa: F401

    if not torch.npu.is_available():
        pytest.skip("no NPU device")
    return "npu"


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_real_device_replays_equal_eager(kind, executor):
    """W2 and W3 and a KV-cache decoder captured into the device's own graphs (CUDA graphs,
    NPUGraph): replays equal eager on the CPU, earlier outputs stay intact, and the report says
    captured."""
    device = _real_device(kind)
    skip_unless_executor(executor)
    torch.manual_seed(0)
    cases = [
        (MLP(64, 3).eval(), [(torch.randn(2, 64),) for _ in range(4)]),
        (DecoderBlock(64, 4).eval(), [(torch.randn(1, 8, 64),) for _ in range(4)]),
        (
            DecoderBlock(64, 4, cache_len=16).eval(),
            [(torch.randn(1, 1, 64), torch.tensor([i])) for i in range(8)],
        ),
    ]
    for model, calls in cases:
        eager = copy.deepcopy(model)
        f = compiled(copy.deepcopy(model).to(device), executor)
        results = []
        with recording_compiles() as built, torch.no_grad():
            for inputs in calls:
                want = eager(*inputs)
                results.append((f(*(x.to(device) for x in inputs)), want))
        for got, want in results:
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
        assert only_graph(built).capture_report().captured == 1
