"""The on-disk compile cache: a hit behaves exactly like a miss.

Each regression test here failed on the cache this module's tests were written against: entries
with tensor constants loaded as meta tensors in a second process, keys computed inside fake mode,
stale hits after a helper or a pass changed, weights frozen on a hit, an unusable directory
failing the compile, hits that hid dumps and source lines, and a cache that only grew.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from conftest import EXECUTORS, run_child, skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt import cache
from fxrt.cache.store import Store
from fxrt.models import MLP, DecoderBlock
from fxrt.serialize import SerializationError

MODELS = {
    "mlp": lambda: (MLP(32, 2).eval(), (torch.randn(2, 32),)),
    "decoder": lambda: (DecoderBlock(32, 2).eval(), (torch.randn(1, 4, 32),)),
    "chain": lambda: (lambda x: x.sin().view(-1, 2).t() * 2, (torch.randn(4, 3),)),
}


def entries(root) -> list:
    return sorted(Store(root).entry_files())


def config(tmp_path, executor="python", **kw) -> fxrt.CompilerConfig:
    return fxrt.CompilerConfig(cache_dir=str(tmp_path), pure_python=executor == "python", **kw)


# ----------------------------------------------------------------------------------------------
# Artifacts


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", list(MODELS))
def test_dump_load_and_pickle_round_trip(name, executor):
    skip_unless_executor(executor)
    model, inputs = MODELS[name]()
    with torch.no_grad():
        gm = make_fx(model)(*inputs)
    cfg = fxrt.CompilerConfig(pure_python=executor == "python", cache=False)
    cg = fxrt.compile_graph(gm, inputs, cfg)
    other = tuple(torch.randn_like(x) for x in inputs)
    with torch.no_grad():
        loaded = fxrt.CompiledGraph.load_artifacts(cg.dump_artifacts(), cg.config)
        unpickled = pickle.loads(pickle.dumps(cg))
        for args in (inputs, other):
            want = model(*args)
            torch.testing.assert_close(loaded(*args), want)
            torch.testing.assert_close(unpickled(*args), want)
        assert str(loaded.program) == str(cg.program)
        assert loaded.executor == executor


def test_graph_with_higher_order_op_is_not_serializable():
    def f(x):
        return torch.cond(x.sum() > 0, lambda a: a + 1, lambda a: a - 1, (x,))

    x = torch.randn(3)
    cg = fxrt.compile_graph(make_fx(f)(x), [x], fxrt.CompilerConfig(cache=False))
    with pytest.raises(SerializationError, match="cannot serialize higher-order op cond"):
        cg.dump_artifacts()


# ----------------------------------------------------------------------------------------------
# Hits and misses in one process


def _sum_cos(tmp_path, executor="python"):
    x = torch.randn(4, 3)
    gm = make_fx(lambda x: (x.cos() + 1).sum(0))(x)
    cfg = config(tmp_path, executor)
    fxrt.compile_graph(gm, [x], cfg)
    (entry,) = entries(tmp_path)
    return cfg, gm, x, entry


def test_cache_hit_skips_compilation(tmp_path):
    cfg, gm, x, _ = _sum_cos(tmp_path)
    before = dict(cache.stats)
    cg = fxrt.compile_graph(gm, [x], cfg)
    assert cache.stats["compiled"] == before.get("compiled", 0)
    assert cache.stats["hit"] == before.get("hit", 0) + 1
    y = torch.randn(4, 3)
    torch.testing.assert_close(cg(y), (y.cos() + 1).sum(0))
    fxrt.compile_graph(gm, [x], config(tmp_path, cache=False))
    assert cache.stats["compiled"] == before.get("compiled", 0) + 1


def test_key_depends_on_constant_values(tmp_path):
    x = torch.randn(2, 8)
    for seed in (0, 1):
        torch.manual_seed(seed)
        lin = torch.nn.Linear(8, 8)
        with torch.no_grad():
            cg = fxrt.compile_graph(make_fx(lin)(x), [x], config(tmp_path))
            torch.testing.assert_close(cg(x), lin(x))
    assert len(entries(tmp_path)) == 2


@pytest.mark.parametrize("executor", EXECUTORS)
def test_weights_stay_live_on_a_hit(tmp_path, executor):
    """Parameters are the caller's live tensors on a hit as on a miss: in-place updates after
    compiling change the next result, and no weight bytes are stored in the cache."""
    skip_unless_executor(executor)
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with torch.no_grad():
        gm = make_fx(lin)(x)
        fxrt.compile_graph(gm, [x], config(tmp_path, executor))  # the miss
        cg = fxrt.compile_graph(gm, [x], config(tmp_path, executor))  # the hit
        assert cache.stats["hit"] >= 1
        lin.weight.mul_(2)
        lin.bias.add_(1)
        torch.testing.assert_close(cg(x), lin(x))
    assert Store(tmp_path).blob_files() == []  # weights are the caller's, never copied


def test_tensor_constant_under_fake_mode_loads_real(tmp_path):
    """Dynamo calls the backend under its fake mode; a hit still has real constants."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = torch.tensor([2.0, 3.0])
    x = torch.randn(2)
    gm = make_fx(lambda x: x * c + c.sum())(x)
    cfg = config(tmp_path)
    fxrt.compile_graph(gm, [x], cfg)
    with FakeTensorMode():
        cg = fxrt.compile_graph(gm, [x], cfg)
    assert cache.stats["hit"] >= 1
    assert all(not t.is_meta for _, t in cg.program.constants if isinstance(t, torch.Tensor))
    torch.testing.assert_close(cg(x), x * c + c.sum())


def test_folded_constants_are_stored_once(tmp_path):
    """Tensors are stored by content hash: two entries with the same folded tensor share it."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    for batch in (1, 2):
        x = torch.randn(batch, 16)
        with torch.no_grad():
            gm = make_fx(lambda x: x @ lin.weight.t().clone())(x)
            cg = fxrt.compile_graph(gm, [x], config(tmp_path, freeze=True))
            torch.testing.assert_close(cg(x), x @ lin.weight.t())
    store = Store(tmp_path)
    assert len(store.entry_files()) == 2
    assert len(store.blob_files()) == 1


# ----------------------------------------------------------------------------------------------
# Stale keys


def test_editing_an_allow_in_graph_helper_misses(tmp_path, monkeypatch):
    """A helper Dynamo keeps as a call is keyed by its code, not by its name."""
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    source = tmp_path / "fxrt_test_helpers.py"
    x = torch.randn(5)
    for body, want in (("x * 2", x * 2), ("x * 3 ", x * 3)):
        source.write_text(f"def helper(x):\n    return {body}\n")
        importlib.invalidate_caches()
        module = (
            importlib.reload(sys.modules["fxrt_test_helpers"])
            if "fxrt_test_helpers" in (sys.modules)
            else importlib.import_module("fxrt_test_helpers")
        )
        helper = torch._dynamo.allow_in_graph(module.helper)
        torch._dynamo.reset()
        f = torch.compile(lambda x, h=helper: h(x) + 1, backend="fxrt", options=_opts(tmp_path))
        torch.testing.assert_close(f(x), want + 1)
    sys.modules.pop("fxrt_test_helpers", None)


SCALE = 2.0


def _scaled(x):
    return (x * SCALE).relu().view(-1, 2).sum(-1)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_changed_global_or_option_misses_before_the_trace(tmp_path, monkeypatch, dynamic):
    """The key of Dynamo's graph sees what its trace would: a global the function reads (Dynamo
    bakes its value in) and every option that changes the traced or compiled graph."""

    def run(options=None):
        torch._dynamo.reset()
        opts = {**_opts(tmp_path), **(options or {})}
        f = torch.compile(_scaled, backend="fxrt", options=opts, dynamic=dynamic)
        before = dict(cache.stats)
        for n in (8, 12):
            x = torch.randn(n)
            torch.testing.assert_close(f(x), _scaled(x))
        return {k: cache.stats[k] - before.get(k, 0) for k in ("hit", "miss")}

    assert run()["miss"] >= 1
    assert run()["miss"] == 0  # the same: hits only
    monkeypatch.setattr(sys.modules[__name__], "SCALE", -3.0)
    assert run()["miss"] >= 1  # the global changed
    assert run({"opt_level": 1})["miss"] >= 1  # an option changed
    assert run({"disable_patterns": ["rms_norm"]})["miss"] >= 1


def test_pass_factories_with_other_closures_miss(tmp_path):
    """User passes are keyed by their code and the values they close over."""

    def scale_outputs_by(k):
        def post_pass(gm, example_inputs, config):
            for node in gm.graph.nodes:
                if node.op == "output":
                    (out,) = node.args[0]
                    with gm.graph.inserting_before(node):
                        scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (out, k))
                    node.args = ((scaled,),)
            gm.recompile()

        return post_pass

    x = torch.randn(4)
    for k in (2.0, 5.0):
        torch._dynamo.reset()
        opts = {**_opts(tmp_path), "post_grad_custom_pre_pass": scale_outputs_by(k)}
        f = torch.compile(lambda x: (x.sin(),), backend="fxrt", options=opts)
        torch.testing.assert_close(f(x)[0], x.sin() * k)


def test_unfingerprintable_closure_is_compiled_not_cached(tmp_path, caplog):
    class Opaque:
        pass

    opaque = Opaque()

    def pre_pass(gm, example_inputs, config):
        assert opaque is not None

    x = torch.randn(3)
    torch._dynamo.reset()
    before = cache.stats["uncached"]
    with caplog.at_level(logging.DEBUG, logger="fxrt"):
        opts = {**_opts(tmp_path), "post_grad_custom_pre_pass": pre_pass}
        f = torch.compile(lambda x: x.cos(), backend="fxrt", options=opts)
        torch.testing.assert_close(f(x), x.cos())
    assert cache.stats["uncached"] == before + 1
    assert "not caching" in caplog.text and "Opaque" in caplog.text
    assert entries(tmp_path) == []


def test_source_hash_follows_content():
    """Touching a file changes nothing; the hash is of content, not of times."""
    before = cache.source_hash()
    cache.source_hash.cache_clear()
    path = os.path.join(os.path.dirname(fxrt.__file__), "errors.py")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        assert cache.source_hash() == before
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        cache.source_hash.cache_clear()


def _opts(tmp_path) -> dict:
    return {"cache_dir": str(tmp_path), "pure_python": True}


# ----------------------------------------------------------------------------------------------
# Storage: unusable directories, damaged entries, eviction, the CLI


@pytest.mark.parametrize("where", ["a_file", "unwritable"])
def test_unusable_directory_compiles_without_cache(tmp_path, where):
    if where == "a_file":
        root = tmp_path / "not_a_dir"
        root.write_text("user data")
    else:
        if os.geteuid() == 0:
            pytest.skip("root can write anywhere")
        root = tmp_path / "ro"
        root.mkdir()
        root.chmod(0o500)
    x = torch.randn(3)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="is unusable") as record:
        f = torch.compile(lambda x: x.exp() - 1, backend="fxrt", options=_opts(root))
        torch.testing.assert_close(f(x), x.exp() - 1)
    assert len([w for w in record if "unusable" in str(w.message)]) == 1
    if where == "a_file":
        assert root.read_text() == "user data"


@pytest.mark.parametrize("damage", ["truncated", "bitflip", "foreign", "empty", "blob", "index"])
def test_damaged_entry_warns_is_removed_and_recompiles(tmp_path, damage):
    cfg, gm, x, entry = _sum_cos(tmp_path)
    data = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "bitflip":
        entry.write_bytes(data[:200] + bytes([data[200] ^ 1]) + data[201:])
    elif damage == "foreign":
        entry.write_bytes(b"#!/bin/sh\necho this is not an fxrt artifact\n")
    elif damage == "empty":
        entry.write_bytes(b"")
    elif damage == "index":  # a valid entry of another key written over this one
        index = json.loads((tmp_path / "index.json").read_text())
        (record,) = index["entries"].values()
        record["sha256"] = "0" * 64
        (tmp_path / "index.json").write_text(json.dumps(index))
    else:
        c = torch.tensor([1.0, 2.0])
        gm = make_fx(lambda x: x + c * 2)(torch.randn(2))  # c * 2 is folded, and stored
        x = torch.randn(2)
        cfg = config(tmp_path / "b", freeze=True)
        fxrt.compile_graph(gm, [x], cfg)
        (blob,) = Store(tmp_path / "b").blob_files()
        blob.write_bytes(torch.tensor([1.0, 99.0]).numpy().tobytes())  # tampered constant
        (entry,) = entries(tmp_path / "b")
    before = cache.stats["compiled"]
    with pytest.warns(UserWarning, match="fxrt cache: ignoring unusable entry"):
        cg = fxrt.compile_graph(gm, [x], cfg)
    assert cache.stats["compiled"] == before + 1  # compiled again
    torch.testing.assert_close(cg(x), gm(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stored afresh: the next compile hits cleanly
        fxrt.compile_graph(gm, [x], cfg)
    assert entry.exists()


def test_least_recently_used_entries_are_evicted(tmp_path, caplog):
    fns = [lambda x: x.sin(), lambda x: x.cos(), lambda x: x.tan()]
    x = torch.randn(64)
    gms = [make_fx(f)(x) for f in fns]
    fxrt.compile_graph(gms[0], [x], config(tmp_path))
    size = Store(tmp_path).entry_files()[0].stat().st_size
    cfg = config(tmp_path, cache_max_bytes=int(size * 2.5))
    fxrt.compile_graph(gms[1], [x], cfg)
    fxrt.compile_graph(gms[0], [x], cfg)  # a hit: the sin entry is now the most recent
    with caplog.at_level(logging.INFO, logger="fxrt"):
        fxrt.compile_graph(gms[2], [x], cfg)  # evicts cos, the least recently used
    assert "evicted" in caplog.text
    index = Store(tmp_path).index()
    assert len(index) == 2
    before = cache.stats["hit"]
    fxrt.compile_graph(gms[0], [x], cfg)
    fxrt.compile_graph(gms[2], [x], cfg)
    assert cache.stats["hit"] == before + 2


def test_logging_names_the_graph(tmp_path, caplog):
    x = torch.randn(3)
    gm = make_fx(lambda x: x.abs())(x)
    with caplog.at_level(logging.INFO, logger="fxrt"):
        fxrt.compile_graph(gm, [x], config(tmp_path))
        fxrt.compile_graph(gm, [x], config(tmp_path))
    text = caplog.text
    assert "miss" in text and "stored" in text and "hit" in text
    key = Store(tmp_path).entry_files()[0].stem
    assert key[:16] in text


def test_cache_cli(tmp_path):
    _sum_cos(tmp_path)
    user_file = tmp_path / "my_model.fxrt"
    user_file.write_bytes(b"the user's own file")
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "notes.fxrt").write_bytes(b"also the user's")
    run = [sys.executable, "-m", "fxrt", "cache"]
    out = subprocess.run([*run, "info", "--dir", str(tmp_path)], capture_output=True, text=True)
    assert "entries:   1" in out.stdout
    out = subprocess.run([*run, "list", "--dir", str(tmp_path)], capture_output=True, text=True)
    assert "1 entries" in out.stdout and "graph of 3 ops" in out.stdout, out.stdout
    # Both kinds of entries, each with its level: one keyed on an ATen graph (above), one on
    # Dynamo's graph before the trace.
    torch._dynamo.reset()
    f = torch.compile(lambda x: x.cos() * 3, backend="fxrt", options={"cache_dir": str(tmp_path)})
    f(torch.randn(5))
    out = subprocess.run([*run, "list", "--dir", str(tmp_path)], capture_output=True, text=True)
    levels = [line.split()[1] for line in out.stdout.splitlines()[1:-1]]
    assert sorted(levels) == ["aten", "dynamo"], out.stdout
    out = subprocess.run([*run, "info", "--dir", str(tmp_path)], capture_output=True, text=True)
    assert "entries:   2" in out.stdout
    out = subprocess.run([*run, "clear", "--dir", str(tmp_path)], capture_output=True, text=True)
    assert "removed 2 entries" in out.stdout
    assert entries(tmp_path) == []
    assert user_file.read_bytes() == b"the user's own file"
    assert (tmp_path / "ab" / "notes.fxrt").exists()


def test_cache_list_does_not_import_torch(tmp_path):
    _sum_cos(tmp_path)
    code = (
        "import runpy, sys; sys.argv = ['fxrt', 'cache', 'list', '--dir', sys.argv[1]]\n"
        "try:\n    runpy.run_module('fxrt', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "1 entries" in out.stdout


# ----------------------------------------------------------------------------------------------
# A second process on the same cache


TENSOR_LITERAL = """
    import json, sys, torch, fxrt
    x = torch.randn(3, requires_grad=sys.argv[1] == "train")
    f = torch.compile(lambda x: x * torch.tensor(2.0) + 1, backend="fxrt")
    for args in (x, torch.randn(3)):
        out = f(args)
        torch.testing.assert_close(out, args * 2.0 + 1)
    if x.requires_grad:
        f(x).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    print(json.dumps(dict(fxrt.cache.stats)))
"""


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("mode", ["inference", "train"])
def test_tensor_literal_cold_and_warm(tmp_path, executor, mode):
    skip_unless_executor(executor)
    cold = run_child(TENSOR_LITERAL, tmp_path, executor, mode)
    warm = run_child(TENSOR_LITERAL, tmp_path, executor, mode)
    assert cold.get("hit", 0) == 0 and cold.get("stored", 0) >= 1, cold
    assert warm.get("hit", 0) >= 1 and warm.get("rejected", 0) == 0, warm


WEIGHTS = """
    import json, torch, fxrt
    from torch.fx.experimental.proxy_tensor import make_fx
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with torch.no_grad():
        cg = fxrt.compile_graph(make_fx(lin)(x), [x])
        lin.weight.mul_(-1)
        torch.testing.assert_close(cg(x), lin(x))
    print(json.dumps(dict(fxrt.cache.stats)))
"""


@pytest.mark.parametrize("executor", EXECUTORS)
def test_weight_updates_after_a_hit_in_a_second_process(tmp_path, executor):
    skip_unless_executor(executor)
    assert run_child(WEIGHTS, tmp_path, executor).get("hit", 0) == 0
    assert run_child(WEIGHTS, tmp_path, executor).get("hit", 0) == 1


ERROR_LINE = """
    import json, sys, torch, fxrt
    def lookup(table, idx):
        return table.index_select(0, idx) * 2
    f = torch.compile(lookup, backend="fxrt")
    table = torch.randn(4, 3)
    f(table, torch.tensor([0, 1]))
    try:
        f(table, torch.tensor([0, 9]))
    except IndexError as e:  # eager's type, with fxrt's context
        assert isinstance(e, fxrt.ExecutionError)
        msg = str(e)
    print(json.dumps({"message": msg, **fxrt.cache.stats}))
"""


def test_errors_on_a_hit_name_this_processes_source_lines(tmp_path):
    cold = run_child(ERROR_LINE, tmp_path, "python")
    shifted = "\n\n\n" + textwrap.dedent(ERROR_LINE)  # the same code, three lines further down
    warm = run_child(shifted, tmp_path, "python")
    assert warm.get("hit", 0) >= 1
    assert "line 4, in lookup" in cold["message"], cold["message"]
    assert "line 7, in lookup" in warm["message"], warm["message"]


DUMP = """
    import json, torch, fxrt
    f = torch.compile(lambda x: (x + 1).relu(), backend="fxrt")
    f(torch.randn(4))
    print(json.dumps(dict(fxrt.cache.stats)))
"""


def test_dump_dir_is_written_on_a_hit(tmp_path):
    cold_dir, warm_dir = tmp_path / "cold", tmp_path / "warm"
    run_child(DUMP, tmp_path / "c", "python", env={"FXRT_DUMP_DIR": str(cold_dir)})
    warm = run_child(DUMP, tmp_path / "c", "python", env={"FXRT_DUMP_DIR": str(warm_dir)})
    assert warm.get("hit", 0) == 1
    (cold_graph,) = cold_dir.iterdir()
    (warm_graph,) = warm_dir.iterdir()
    assert (warm_graph / "program.txt").read_text() == (cold_graph / "program.txt").read_text()
    assert "compile cache entry" in (warm_graph / "cache_hit.txt").read_text()


def test_two_processes_compiling_one_key_at_once(tmp_path):
    env = {**os.environ, "FXRT_CACHE_DIR": str(tmp_path), "FXRT_PURE_PYTHON": "1"}
    script = textwrap.dedent(DUMP)
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    assert all(p.wait(timeout=300) == 0 for p in procs)
    (entry,) = entries(tmp_path)
    assert len(Store(tmp_path).index()) == 1
    assert not [p for p in tmp_path.rglob(".tmp-*")]
    assert run_child(DUMP, tmp_path, "python").get("hit", 0) == 1


# ----------------------------------------------------------------------------------------------
# Storing an entry never fails a compile


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_folded_stride_zero_constant_is_stored_and_hits(tmp_path, executor):
    # quantile of a 0-d tensor folds to a constant of sizes (1,) and strides (0,): storing it
    # failed the compile.
    skip_unless_executor(executor)
    opts = {"cache_dir": str(tmp_path), "pure_python": executor == "python"}
    for attempt in ("cold", "warm"):
        torch._dynamo.reset()
        before = dict(cache.stats)
        f = torch.compile(lambda x, q: torch.quantile(x, q), backend="fxrt", options=opts)
        for v in (3.0, -1.5):
            x = torch.tensor(v)
            torch.testing.assert_close(f(x, 0.5), torch.quantile(x, 0.5))
        kind = "stored" if attempt == "cold" else "hit"
        assert cache.stats[kind] > before.get(kind, 0), (attempt, dict(cache.stats))


def test_a_store_that_fails_warns_and_the_graph_still_works(tmp_path, monkeypatch):
    import fxrt.cache.lookup

    def broken(*args, **kwargs):
        raise RuntimeError("cannot encode this")

    monkeypatch.setattr(fxrt.cache.lookup, "encode_graph", broken)
    x = torch.randn(4, 3)
    gm = make_fx(lambda x: (x.cos() + 1).sum(0))(x)
    with pytest.warns(UserWarning, match="not stored.*cannot encode this"):
        cg = fxrt.compile_graph(gm, [x], config(tmp_path))
    y = torch.randn(4, 3)
    torch.testing.assert_close(cg(y), (y.cos() + 1).sum(0))
    assert entries(tmp_path) == []


def test_writers_sharing_a_directory_keep_each_others_blobs(tmp_path):
    # Two processes (here threads, which flock separates too) storing at once: one's clean-up of
    # unused blobs must not remove the blobs of an entry the other is storing, whose record is
    # not in the index yet (its entry then misses bytes, and every later lookup compiles again).
    import hashlib
    import threading

    def writer(w: int) -> None:
        store = Store(tmp_path)
        for i in range(150):
            payload = f"{w}-{i}".encode() * 64
            sha = hashlib.sha256(payload).hexdigest()
            key = hashlib.sha256(f"key-{w}-{i}".encode()).hexdigest()
            store.write(key, b"entry", {sha: payload}, {"name": f"w{w}"})

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store = Store(tmp_path)
    entries = store.index()
    assert len(entries) == 300
    missing = [
        sha for r in entries.values() for sha in r["blobs"] if not store.blob_path(sha).exists()
    ]
    assert missing == [], f"{len(missing)} blobs of indexed entries were removed"
