"""PyTorch's own precompile with ``backend="fxrt"``: ``aot_compile`` -> ``save_compiled_function``
-> ``load_compiled_function`` in a fresh process, and ``TORCH_CACHING_PRECOMPILE=1`` across two
processes. Each loads in a process that never compiles and compares with eager on new inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import EXECUTORS, run_child, skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt import precompile
from fxrt.serialize import SerializationError

SAVE = """
    import json, sys, torch, fxrt
    from fxrt.models import DecoderBlock
    torch.manual_seed(0)
    kind, path = sys.argv[1], sys.argv[2]
    options = {"arena_max_idle": 1}
    if kind == "module":
        model = DecoderBlock(32, 2).eval()
        x = torch.randn(1, 4, 32)
        compiled = torch.compile(model, fullgraph=True, backend="fxrt", options=options)
        with torch.no_grad():
            c = compiled.forward.aot_compile(((x,), {}))
            torch.testing.assert_close(c(model, x), model(x))
        torch.save(model.state_dict(), path + ".weights")
    else:
        fn = lambda x, y: (x.sin() * y).sum(-1) + y.shape[0]
        x, y = torch.randn(5, 6), torch.randn(5, 6)
        compiled = torch.compile(fn, fullgraph=True, backend="fxrt", options=options,
                                 dynamic=kind == "dynamic")
        c = compiled.aot_compile(((x, y), {}))
        torch.testing.assert_close(c(x, y), fn(x, y))
    c.save_compiled_function(path)
    print(json.dumps(dict(fxrt.cache.stats)))
"""

LOAD = """
    import json, sys, torch, fxrt
    from fxrt.models import DecoderBlock
    torch.manual_seed(1)
    kind, path = sys.argv[1], sys.argv[2]
    with open(path, "rb") as f:
        c = torch.compiler.load_compiled_function(f)
    if kind == "module":
        model = DecoderBlock(32, 2).eval()
        model.load_state_dict(torch.load(path + ".weights"))
        with torch.no_grad():
            for _ in range(2):
                x = torch.randn(1, 4, 32)
                torch.testing.assert_close(c(model, x), model(x))
            model.ln1.weight.mul_(-1)  # weights stay live: the module's, read at each call
            torch.testing.assert_close(c(model, x), model(x))
    else:
        fn = lambda x, y: (x.sin() * y).sum(-1) + y.shape[0]
        shapes = [(5, 6), (5, 6)] if kind == "static" else [(3, 6), (9, 4)]
        for shape in shapes:
            x, y = torch.randn(shape), torch.randn(shape)
            torch.testing.assert_close(c(x, y), fn(x, y))
    import gc
    graphs = [g for g in gc.get_objects() if isinstance(g, fxrt.CompiledGraph)]
    compile_side = ["fxrt.pipeline", "fxrt.passes", "fxrt.patterns", "fxrt.cache.keys",
                    "fxrt.cache.lookup", "fxrt.exec.capture"]
    print(json.dumps({**fxrt.cache.stats, "executors": [g.executor for g in graphs],
                      "arena_max_idle": [g.config.arena_max_idle for g in graphs],
                      "imported": [m for m in compile_side if m in sys.modules]}))
"""


@pytest.mark.parametrize("kind", ["module", "static", "dynamic"])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_aot_compile_save_and_load_in_a_fresh_process(tmp_path, executor, kind):
    skip_unless_executor(executor)
    path = str(tmp_path / "compiled.bin")
    saved = run_child(SAVE, tmp_path / "cache", executor, kind, path)
    assert saved.get("compiled", 0) + saved.get("hit", 0) >= 1, saved
    # Another cache directory: the loading process has nothing to hit; it must not compile.
    loaded = run_child(LOAD, tmp_path / "other", executor, kind, path)
    assert loaded.get("compiled", 0) == 0 and loaded.get("hit", 0) == 0, loaded
    assert loaded["executors"] == [executor], loaded  # one graph, on the loop asked for
    assert loaded["arena_max_idle"] == [1], loaded  # with the options it was compiled with
    # A load imports none of the compile side (the passes, patterns, the cache's keys and lookup,
    # capture): most of what a precompiled start spent in fxrt was importing them.
    assert loaded["imported"] == [], loaded


CACHING = """
    import json, sys, torch, fxrt
    from fxrt.models import DecoderBlock
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = DecoderBlock(32, 2).eval()
    f = torch.compile(model, backend="fxrt")
    torch.manual_seed(int(sys.argv[1]))
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(1, 4, 32)
            torch.testing.assert_close(f(x), model(x))
    torch.compiler.save_cache_artifacts()
    print(json.dumps({**fxrt.cache.stats, **counters["dynamo_cache"],
                      "graphs": counters["stats"]["unique_graphs"]}))
"""


@pytest.mark.parametrize("executor", EXECUTORS)
def test_caching_precompile_across_two_processes(tmp_path, executor):
    skip_unless_executor(executor)
    env = {"TORCH_CACHING_PRECOMPILE": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch")}
    cold = run_child(CACHING, tmp_path / "fxrt", executor, "1", env=env)
    assert cold.get("compiled", 0) == 1 and cold.get("dynamo_cache_miss", 0) == 1, cold
    # The second process gets Dynamo's entry with fxrt's bytes: neither Dynamo nor fxrt
    # compiles (not even a hit in fxrt's own cache: it is never asked).
    env["FXRT_CACHE_DIR"] = str(tmp_path / "empty")
    warm = run_child(CACHING, tmp_path / "empty", executor, "2", env=env)
    assert warm.get("dynamo_cache_hit", 0) == 1 and warm["graphs"] == 0, warm
    assert warm.get("compiled", 0) == 0 and warm.get("hit", 0) == 0, warm


def test_a_training_graph_is_refused_plainly():
    torch._dynamo.reset()
    lin = torch.nn.Linear(4, 4)
    compiled = torch.compile(lin, fullgraph=True, backend="fxrt")
    with pytest.raises(Exception, match="inference graphs only.*torch.no_grad"):
        compiled.forward.aot_compile(((torch.randn(2, 4),), {}))


def _sample(executor: str, **options) -> fxrt.CompiledGraph:
    x = torch.randn(3, 4)
    cfg = fxrt.CompilerConfig(cache=False, pure_python=executor == "python", **options)
    return fxrt.compile_graph(make_fx(lambda x: (x * 2).relu() + 1)(x), [x], cfg)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_bytes_carry_the_options_the_graph_runs_under(executor):
    skip_unless_executor(executor)
    cg = _sample(executor, arena_max_idle=0, check_inputs=False, dump_dir="/nonexistent")
    data = fxrt.CompiledGraph.serialize_compile_artifacts(cg)
    loaded = fxrt.CompiledGraph.deserialize_compile_artifacts(data)
    assert loaded.executor == cg.executor
    assert (loaded.config.arena_max_idle, loaded.config.check_inputs) == (0, False)
    assert loaded.config.dump_dir != "/nonexistent"  # the loading process's own
    x = torch.randn(3, 4)
    torch.testing.assert_close(loaded(x), (x * 2).relu() + 1)


def test_other_bytes_are_refused():
    cg = _sample("python")
    data = precompile.serialize(cg)
    with pytest.raises(SerializationError, match="not fxrt-precompiled"):
        fxrt.CompiledGraph.deserialize_compile_artifacts(
            cg.dump_artifacts()
        )  # an artifact, not precompile data
    with pytest.raises(SerializationError):
        fxrt.CompiledGraph.deserialize_compile_artifacts(data[:-5])
    with pytest.raises(SerializationError, match="must be bytes"):
        fxrt.CompiledGraph.deserialize_compile_artifacts("text")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [{"cache_dir": "/tmp/elsewhere"}, {"mode": "warp"}, {"no_such": 1}, {"capture_limit": 0}, []],
)
def test_invalid_options_are_refused(options):
    from test_artifacts import repack

    def edit(doc):
        doc["precompiled"]["options"] = options

    data = repack(precompile.serialize(_sample("python")), edit)
    with pytest.raises(SerializationError, match="invalid options"):
        fxrt.CompiledGraph.deserialize_compile_artifacts(data)


def test_a_graph_the_format_cannot_hold_names_itself():
    torch._dynamo.reset()

    def f(x):
        return torch.cond(x.sum() > 0, lambda a: a + 1, lambda a: a - 1, (x,))

    compiled = torch.compile(f, fullgraph=True, backend="fxrt")
    with torch.no_grad():
        c = compiled.aot_compile(((torch.randn(3),), {}))
    with pytest.raises(SerializationError, match="cannot save graph.* for precompile.*cond"):
        c.save_compiled_function("/dev/null")


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.float32])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_aot_compile_takes_0d_tensor_inputs(executor, dtype):
    # Dynamo gives every 0-d CPU tensor input a memo for ``.item()``; a graph that uses it as a
    # tensor (a serving engine's handle tensors) has nothing to specialize, and aot_compile
    # cannot restart Dynamo.
    skip_unless_executor(executor)
    torch._dynamo.reset()

    def f(x, h):
        return x * 2 + h

    compiled = torch.compile(
        f, fullgraph=True, backend="fxrt", options={"pure_python": executor == "python"}
    )
    x, h = torch.randn(4, 8, dtype=torch.float64), torch.tensor(3, dtype=dtype)
    with torch.no_grad():
        c = compiled.aot_compile(((x, h), {}))
        other = (torch.randn(4, 8, dtype=torch.float64), torch.tensor(5, dtype=dtype))
        for args in [(x, h), other]:
            torch.testing.assert_close(c(*args), f(*args))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_aot_compile_reads_a_float_input_without_a_restart(executor):
    # Under dynamic=True a Python float becomes a 0-d tensor read with .item(); torch.compile
    # restarts Dynamo with it specialized, aot_compile cannot: the read stays symbolic and one
    # compiled function serves every value.
    skip_unless_executor(executor)
    torch._dynamo.reset()

    def f(x, s):
        return x * s + (s * 2 - 1)

    compiled = torch.compile(
        f,
        fullgraph=True,
        backend="fxrt",
        dynamic=True,
        options={"pure_python": executor == "python"},
    )
    x = torch.randn(4, 8)
    with torch.no_grad():
        c = compiled.aot_compile(((x, 2.5), {}))
        for s in (2.5, 0.25, -3.0):
            x = torch.randn(4, 8)
            torch.testing.assert_close(c(x, s), f(x, s))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_aot_compile_folds_a_float_dynamo_pinned(executor):
    # LayerNorm's eps as a float argument under dynamic=True: Dynamo's trace already guards on
    # its value, and the op needs a number. torch.compile would restart with it specialized;
    # under aot_compile fxrt folds the guarded value in, and the guard refuses another eps.
    skip_unless_executor(executor)
    torch._dynamo.reset()

    def f(x, eps):
        return torch.nn.functional.layer_norm(x, (8,), eps=eps) * 2

    compiled = torch.compile(
        f,
        fullgraph=True,
        backend="fxrt",
        dynamic=True,
        options={"pure_python": executor == "python"},
    )
    with torch.no_grad():
        c = compiled.aot_compile(((torch.randn(3, 8), 1e-5), {}))
        for shape in [(3, 8), (6, 8)]:
            x = torch.randn(shape)
            torch.testing.assert_close(c(x, 1e-5), f(x, 1e-5))
        with pytest.raises(RuntimeError, match="eps"):
            c(x, 0.5)
