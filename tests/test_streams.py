"""Multi-stream execution on the CPU, both loops, against eager: TorchAir's multi-stream example
through a user pre pass, ``fxrt.stream_scope`` in a model, the verifier's inserted syncs and
``strict_streams``, Python fallbacks and failures on a side stream, threads, and random graphs
with random stream assignments (values, and that no buffer is freed or its arena bytes reused
before every stream that uses it is done)."""

from __future__ import annotations

import copy
import json
import logging
import threading
from typing import Any

import pytest
import torch
import torch._dynamo
from conftest import native_available, recording_compiles, skip_unless_executor
from graphgen import GeneratedGraph, generated_graphs
from hypothesis import given, note, settings
from hypothesis import strategies as st

import fxrt
from fxrt.exec.program import Free, Record, Stream, Wait
from fxrt.ir import refs_in
from fxrt.ops.streams import LABEL_KEY, register_torchair_compat
from fxrt.passes.synchronize_streams import StreamError

register_torchair_compat()
air = torch.ops.air
LOOPS = ["python", "cpp"] if native_available() else ["python"]


def compiled(fn: Any, executor: str, **options: Any) -> Any:
    skip_unless_executor(executor)
    torch._dynamo.reset()
    opts = {"pure_python": executor == "python", "cache": False, **options}
    return torch.compile(fn, backend="fxrt", options=opts)


# --- TorchAir's multi-stream guide example ----------------------------------------------------


def torchair_pre_pass(gm: torch.fx.GraphModule, example_inputs: Any, config: Any) -> None:
    """The pass from TorchAir's guide: ``mm`` and ``abs`` on ``stream_1`` (scope_enter before
    mm; record and scope_exit after abs), and a wait for that record before ``sub``."""
    g = gm.graph
    record = None
    for node in list(g.nodes):
        if node.target == torch.ops.aten.mm.default:
            with g.inserting_before(node):
                g.call_function(air.scope_enter.default, ([LABEL_KEY], ["stream_1"]))
        elif node.target == torch.ops.aten.abs.default:
            with g.inserting_after(node):
                exit_ = g.call_function(air.scope_exit.default, ())
            with g.inserting_before(exit_):
                record = g.call_function(air.record.default, ())
        elif node.target == torch.ops.aten.sub.Tensor:
            with g.inserting_before(node):
                g.call_function(air.wait.default, ([record],))


def torchair_example(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    a = torch.mm(x, y).abs()
    b = torch.add(x, y)
    return torch.sub(a, b)


def test_torchair_example(executor, tmp_path, caplog):
    fn = compiled(torchair_example, executor, post_grad_custom_pre_pass=torchair_pre_pass)
    with recording_compiles() as built, caplog.at_level(logging.INFO, "fxrt.streams"):
        for _ in range(3):
            x, y = torch.randn(8, 8), torch.randn(8, 8)
            torch.testing.assert_close(fn(x, y), torchair_example(x, y))
    (cg,) = built
    assert cg.executor == executor
    assert not [r for r in caplog.records if "inserted" in r.message]  # the pass synchronizes
    text = str(cg.program)
    assert "STREAM 1 ('stream_1')" in text and "RECORD" in text and "WAIT" in text
    assert cg.program.streams is not None and cg.program.streams.labels == (None, "stream_1")
    with fxrt.profile() as prof:
        fn(torch.randn(8, 8), torch.randn(8, 8))
    streams = {e.node: e.stream for e in prof.nodes}
    assert streams["mm"] == streams["abs_1"] == "stream_1" and streams["sub"] is None
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    tid = {e["name"]: e["tid"] for e in events if e.get("cat") == "fxrt.node"}
    assert tid["mm"] == tid["abs_1"] != tid["sub"]


# --- stream_scope in a model ----------------------------------------------------------------


class TwoBranches(torch.nn.Module):
    def __init__(self, width: int = 32, depth: int = 3):
        super().__init__()
        self.a = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
        self.b = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with fxrt.stream_scope("side"):
            a = torch.nn.functional.gelu(self.a(x))
            ev = fxrt.record()
        b = torch.nn.functional.gelu(self.b(x))
        fxrt.wait([ev])
        return a * b


@pytest.mark.parametrize("grad", ["no_grad", "inference_mode", "grad"])
def test_stream_scope_in_a_model(executor, grad):
    torch.manual_seed(0)
    model = TwoBranches().eval()
    fn = compiled(model, executor)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(grad)
    with ctx() if ctx else torch.enable_grad(), recording_compiles() as built:
        for _ in range(3):
            x = torch.randn(2, 32)
            got, want = fn(x), model(x)
            torch.testing.assert_close(got, want)
            assert got.requires_grad == want.requires_grad
    assert all(cg.program.streams is not None for cg in built)


def test_stream_scope_does_nothing_in_eager():
    model = TwoBranches()
    x = torch.randn(2, 32)
    with fxrt.stream_scope("s"):
        assert fxrt.record() is None
    torch.testing.assert_close(model(x), model(x))


def test_streams_off_runs_one_stream(executor):
    fn = compiled(TwoBranches().eval(), executor, streams="off")
    with recording_compiles() as built, torch.no_grad():
        fn(torch.randn(2, 32))
    assert built[0].program.streams is None


# --- the verifier ------------------------------------------------------------------------------


def unsynchronized(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with fxrt.stream_scope("side"):
        a = (x @ w).relu()  # reads x, w (inputs: ready on every stream)
    b = a.sin()  # reads a with no wait
    with fxrt.stream_scope("side"):
        c = b * 2  # reads b (made on the caller's stream) with no wait
    return c + a


def test_missing_syncs_are_inserted_and_logged(executor, caplog):
    fn = compiled(unsynchronized, executor)
    with caplog.at_level(logging.INFO, "fxrt.streams"), recording_compiles() as built:
        for _ in range(3):
            x, w = torch.randn(4, 4), torch.randn(4, 4)
            torch.testing.assert_close(fn(x, w), unsynchronized(x, w))
    inserted = [r.getMessage() for r in caplog.records if "inserted" in r.getMessage()]
    assert len(inserted) == 3, inserted  # sin reads a, mul reads b, add reads c
    program = built[0].program
    assert sum(isinstance(i, Wait) for i in program.code) >= 3  # two inserted, one join


def test_strict_streams_names_both_nodes(executor):
    fn = compiled(unsynchronized, executor, strict_streams=True)
    with pytest.raises(Exception, match=r"strict_streams: sin .* relu"):
        fn(torch.randn(4, 4), torch.randn(4, 4))


def test_strict_streams_accepts_a_synchronized_graph(executor):
    fn = compiled(
        torchair_example, executor, post_grad_custom_pre_pass=torchair_pre_pass, strict_streams=True
    )
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(fn(x, y), torchair_example(x, y))


def in_place_across_streams(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    with fxrt.stream_scope("side"):
        s = y.sum()  # reads y
    y.add_(1)  # writes y: must wait for the read on the side stream
    return y + s


def test_write_after_read_across_streams(executor):
    fn = compiled(in_place_across_streams, executor)
    for _ in range(3):
        x = torch.randn(64)
        torch.testing.assert_close(fn(x), in_place_across_streams(x))


def test_unmatched_scope_exit_is_an_error():
    from fxrt.ir import Graph
    from fxrt.ir.graph import Node, Op, ValueKind
    from fxrt.passes.synchronize_streams import synchronize_streams

    g = Graph()
    v = g.add_value("e", ValueKind.NONE)
    g.nodes.append(Node("e", Op.of(torch.ops.fxrt.scope_exit.default), (), {}, [v]))
    with pytest.raises(StreamError, match="scope_exit without"):
        synchronize_streams(g)


# --- Python fallbacks, failures and threads on side streams -----------------------------------


def with_fallback(x: torch.Tensor) -> torch.Tensor:
    with fxrt.stream_scope("side"):
        a = x.cos()
        n = a.shape[0] * 2  # noqa: F841 - a SymInt step under dynamic shapes
        a = torch.ops.higher_order.cond(a.sum() > 0, lambda t: t + 1, lambda t: t - 1, (a,))
        ev = fxrt.record()
    b = x.sin()
    fxrt.wait([ev])
    return a + b


def test_python_fallback_on_a_side_stream(executor):
    fn = compiled(with_fallback, executor)
    with recording_compiles() as built:
        for sign in (1, -1):
            x = sign * torch.rand(16) + sign
            torch.testing.assert_close(fn(x), with_fallback(x))
    assert any(cg.program.fallbacks for cg in built)


def failing_on_side(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    with fxrt.stream_scope("side"):
        a = x[idx]  # an index out of range fails here
    return a + x.sum()


def test_a_failure_on_a_side_stream_is_raised(executor):
    fn = compiled(failing_on_side, executor)
    x = torch.randn(8)
    torch.testing.assert_close(
        fn(x, torch.tensor([1, 2])), failing_on_side(x, torch.tensor([1, 2]))
    )
    with pytest.raises(Exception, match="index"):
        fn(x, torch.tensor([100, 2]))
    torch.testing.assert_close(
        fn(x, torch.tensor([3, 0])), failing_on_side(x, torch.tensor([3, 0]))
    )


def test_calls_from_threads(executor):
    torch.manual_seed(0)
    model = TwoBranches().eval()
    fn = compiled(model, executor)
    with torch.no_grad():
        fn(torch.randn(2, 32))
        errors: list[BaseException] = []

        def work(seed: int) -> None:
            try:
                with torch.no_grad():
                    for k in range(10):
                        x = torch.randn(
                            2, 32, generator=torch.Generator().manual_seed(seed * 99 + k)
                        )
                        torch.testing.assert_close(fn(x), model(x))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]


# --- random graphs, random streams -------------------------------------------------------------


def assign_random_streams(gm: torch.fx.GraphModule, labels: list[Any], own_waits: bool) -> None:
    """Put each call node on ``labels[k]`` (None: the caller's stream) with scope ops around runs
    of one label; with ``own_waits``, also a record after each node on a side stream and a wait
    before each node that reads one made on another stream."""
    g = gm.graph
    nodes = [n for n in g.nodes if n.op == "call_function"]
    stream_of: dict[torch.fx.Node, Any] = {}
    records: dict[torch.fx.Node, torch.fx.Node] = {}
    current = None
    for node, label in zip(nodes, labels):
        stream_of[node] = label
        if label != current:
            with g.inserting_before(node):
                if current is not None:
                    g.call_function(air.scope_exit.default, ())
                if label is not None:
                    g.call_function(air.scope_enter.default, ([LABEL_KEY], [label]))
            current = label
        if own_waits:
            evs = [
                records[p]
                for p in node.all_input_nodes
                if p in stream_of and stream_of[p] != label and p in records
            ]
            if evs:
                with g.inserting_before(node):
                    g.call_function(air.wait.default, (evs,))
            with g.inserting_after(node):
                rec = g.call_function(air.record.default, ())
                rec.meta["val"] = torch.empty(0)
            records[node] = rec
    if current is not None:
        out = next(n for n in g.nodes if n.op == "output")
        with g.inserting_before(out):
            g.call_function(air.scope_exit.default, ())
    g.lint()
    gm.recompile()


def happens_before_violations(cg: fxrt.CompiledGraph) -> list[str]:
    """Check a compiled multi-stream program: every FREE is ordered after every instruction that
    touches what it frees, and arena slots sharing bytes are used one after the other."""
    program, plan = cg.program, cg.plan
    streams = program.streams
    n = len(streams.labels) if streams is not None else 1
    clock = [[0] * n for _ in range(n)]
    events: dict[int, list[int]] = {}
    seq, stream_at, after = {}, {}, {}
    current = 0
    for pc, ins in enumerate(program.code):
        if isinstance(ins, Stream) and not isinstance(ins, (Record, Wait)):
            current = ins.stream
            continue
        if isinstance(ins, Wait):
            for e in ins.events:
                clock[current] = [max(a, b) for a, b in zip(clock[current], events[e])]
        clock[current][current] += 1
        seq[pc], stream_at[pc], after[pc] = clock[current][current], current, list(clock[current])
        if isinstance(ins, Record):
            events[ins.event] = list(clock[current])

    def before(u: int, k: int) -> bool:  # instruction u happens before instruction k
        return (stream_at[u] == stream_at[k] and u < k) or after[k][stream_at[u]] >= seq[u]

    touch: dict[int, list[int]] = {}
    for pc, ins in enumerate(program.code):
        if isinstance(ins, (Free, Stream)):
            continue
        for v in (*refs_in((ins.args, ins.kwargs)), *ins.outputs):
            touch.setdefault(plan.alias_root[v], []).append(pc)
    bad = []
    for pc, ins in enumerate(program.code):
        if isinstance(ins, Free):
            for v in ins.regs:
                bad += [
                    f"FREE at {pc} of %{program.reg_names[v]} before {u}"
                    for u in touch.get(plan.alias_root[v], [])
                    if not before(u, pc)
                ]
    if program.arena is not None:
        made = {
            ins.outputs[0]: pc
            for pc, ins in enumerate(program.code)
            if not isinstance(ins, Free) and not isinstance(ins, Stream) and ins.outputs
        }
        slots = program.arena.slots
        for i, a in enumerate(slots):
            for b in slots[i + 1 :]:
                if not (a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes):
                    continue
                ua = touch.get(plan.alias_root[a.value], [])
                ub = touch.get(plan.alias_root[b.value], [])
                a_then_b = all(before(u, made[b.value]) for u in ua)
                b_then_a = all(before(u, made[a.value]) for u in ub)
                if not (a_then_b or b_then_a):
                    names = program.reg_names
                    bad.append(f"arena bytes of %{names[a.value]} and %{names[b.value]} shared")
    return bad


@settings(max_examples=60, deadline=None)
@given(generated_graphs(), st.data())
def test_random_graphs_on_random_streams(g: GeneratedGraph, data):
    n_calls = len([n for n in g.module.graph.nodes if n.op == "call_function"])
    labels = data.draw(
        st.lists(st.sampled_from([None, "s1", "s2"]), min_size=n_calls, max_size=n_calls)
    )
    own_waits = data.draw(st.booleans())
    gm = g.gm
    assign_random_streams(gm, labels, own_waits)
    note(f"streams {labels}, own waits {own_waits}\n{gm.code}")
    for loop in LOOPS:
        cfg = fxrt.CompilerConfig(pure_python=loop == "python", cache=False)
        cg = fxrt.compile_graph(copy.deepcopy(gm), None, cfg)
        note(str(cg.program))
        assert not happens_before_violations(cg)
        eager = copy.deepcopy(gm)  # its constants change as the compiled graph's do
        for _ in range(3):
            want = eager(*g.inputs())
            got = cg(*g.inputs())
            assert len(got) == len(want)
            for a, b in zip(got, want, strict=True):
                if isinstance(b, torch.Tensor):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
                else:
                    assert a == b


def test_artifact_and_cache_round_trip(executor, tmp_path):
    """A multi-stream graph dumps, loads and is served from the cache like any other: its
    stream ops travel by qualified name, and the loaded program has the same streams."""
    skip_unless_executor(executor)
    opts = {"post_grad_custom_pre_pass": torchair_pre_pass, "cache_dir": str(tmp_path)}
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    programs = []
    for cache in (True, True):  # a miss, then a hit
        fn = compiled(torchair_example, executor, cache=cache, **opts)
        with recording_compiles() as built:
            torch.testing.assert_close(fn(x, y), torchair_example(x, y))
        programs.append(str(built[0].program))
    assert programs[0] == programs[1]
    loaded = fxrt.CompiledGraph.load_artifacts(built[0].dump_artifacts(), built[0].config)
    torch.testing.assert_close(loaded(x, y)[0], torchair_example(x, y))
    assert str(loaded.program) == programs[0]


def test_forked_child_runs_side_streams(executor):
    """A child forked after the workers started makes its own (its parent's threads are not
    there)."""
    import os
    import signal

    model = TwoBranches().eval()
    fn = compiled(model, executor)
    x = torch.randn(2, 32)
    with torch.no_grad():
        fn(x)  # the workers exist now
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when the compiled graph works (and in time)
        ok = False
        try:
            signal.alarm(60)
            # OpenMP's pool is not fork-safe: a parallel region in a child of a process that
            # ran one hangs (an eager op of an earlier test), so the child uses one thread.
            torch.set_num_threads(1)
            with torch.no_grad():
                ok = torch.allclose(fn(x), model(x), rtol=1e-5, atol=1e-6)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


SYNCHRONIZED_IR = """\
graph(%arg0_1: float32[4, 4], %arg1_1: float32[4, 4]):
  %scope_enter: other = fxrt::scope_enter(['_user_stream_label'], ['side'])
  %mm: float32[4, 4] = aten::mm(%arg0_1, %arg1_1)
  %relu: float32[4, 4] = aten::relu(%mm)
  %record: float32[0] = fxrt::record()
  %scope_exit: other = fxrt::scope_exit()
  %wait: none = fxrt::wait([%record])
  %sin: float32[4, 4] = aten::sin(%relu)
  %record_1: float32[0] = fxrt::record()
  %scope_enter_1: other = fxrt::scope_enter(['_user_stream_label'], ['side'])
  %wait_1: none = fxrt::wait([%record_1])
  %mul: float32[4, 4] = aten::mul.Tensor(%sin, 2)
  %record_2: float32[0] = fxrt::record()
  %scope_exit_1: other = fxrt::scope_exit()
  %wait_2: none = fxrt::wait([%record_2])
  %add: float32[4, 4] = aten::add.Tensor(%mul, %relu)
  return (%add,)"""


def test_synchronize_streams_golden_ir():
    """Where the verifier puts what it inserts: a record right after the producer, on its
    stream; a wait right before the consumer, on its stream."""
    from fxrt.ir import graph_to_text

    fn = compiled(unsynchronized, "python")
    with recording_compiles() as built:
        fn(torch.randn(4, 4), torch.randn(4, 4))
    assert graph_to_text(built[0].graph) == SYNCHRONIZED_IR


@torch.library.custom_op("fxrt_test::nap", mutates_args=())
def nap(x: torch.Tensor, seconds: float) -> torch.Tensor:
    """``x + 1`` after sleeping (the GIL released): work that takes time but no CPU."""
    import time

    time.sleep(seconds)
    return x + 1


@nap.register_fake
def _(x: torch.Tensor, seconds: float) -> torch.Tensor:
    return torch.empty_like(x)


def two_naps(x: torch.Tensor) -> torch.Tensor:
    with fxrt.stream_scope("side"):
        a = nap(x, 0.2)
    b = nap(x * 2, 0.2)
    return a + b


def test_side_stream_runs_concurrently_with_the_caller():
    """On the compiled loop the side stream is another thread: two 0.2 s naps, one per stream,
    take about 0.2 s together (sleeping needs no free core, so this holds on a loaded machine);
    on one stream they take 0.4 s."""
    import time

    x = torch.randn(4)
    want = two_naps(x)
    times = {}
    for streams in ("manual", "off"):
        fn = compiled(two_naps, "cpp", streams=streams)
        torch.testing.assert_close(fn(x), want)
        t0 = time.perf_counter()
        got = fn(x)
        times[streams] = time.perf_counter() - t0
        torch.testing.assert_close(got, want)
    assert times["off"] > 0.39
    assert times["manual"] < 0.33, times


STRESS = """
import sys, torch, fxrt
torch.set_num_threads(1)

def f(x):
    with fxrt.stream_scope("s"):
        a = x.sin()
    return a + x.cos()

fn = torch.compile(f, backend="fxrt", options={"cache": False})
x = torch.randn(1, 64)
for _ in range(int(sys.argv[1])):
    out = fn(x)
torch.testing.assert_close(out, f(x))
"""


def test_many_calls_back_to_back(tmp_path):
    """Calls that follow each other at once: the caller must not return (and the next call
    reuse its stack) while a worker still signals the last one. A hang fails after 240 s."""
    import subprocess
    import sys

    skip_unless_executor("cpp")
    script = tmp_path / "stress.py"
    script.write_text(STRESS)
    proc = subprocess.run(
        [sys.executable, str(script), "30000"], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
