"""Artifacts (dump/load, pickle) and the on-disk compile cache."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import EXECUTORS, skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt import cache
from fxrt.models import MLP, DecoderBlock
from fxrt.serialize import SerializationError

MODELS = {
    "mlp": lambda: (MLP(32, 2).eval(), (torch.randn(2, 32),)),
    "decoder": lambda: (DecoderBlock(32, 2).eval(), (torch.randn(1, 4, 32),)),
    "chain": lambda: (lambda x: x.sin().view(-1, 2).t() * 2, (torch.randn(4, 3),)),
}


def compiled(name: str, executor: str = "python", **config):
    model, inputs = MODELS[name]()
    with torch.no_grad():
        gm = make_fx(model)(*inputs)
    cfg = fxrt.CompilerConfig(pure_python=executor == "python", cache=False, **config)
    return fxrt.compile_graph(gm, inputs, cfg), model, inputs


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", list(MODELS))
def test_dump_load_and_pickle_round_trip(name, executor):
    skip_unless_executor(executor)
    cg, model, inputs = compiled(name, executor)
    with torch.no_grad():
        want = model(*inputs)
        loaded = fxrt.CompiledGraph.load_artifacts(cg.dump_artifacts(), cg.config)
        torch.testing.assert_close(loaded(*inputs), want)
        assert str(loaded.program) == str(cg.program)
        assert loaded.executor == executor
        unpickled = pickle.loads(pickle.dumps(cg))
        torch.testing.assert_close(unpickled(*inputs), want)


def test_graph_with_higher_order_op_is_not_serializable():
    def f(x):
        return torch.cond(x.sum() > 0, lambda a: a + 1, lambda a: a - 1, (x,))

    x = torch.randn(3)
    cg = fxrt.compile_graph(make_fx(f)(x), [x], fxrt.CompilerConfig(cache=False))
    with pytest.raises(SerializationError, match="cannot serialize"):
        cg.dump_artifacts()


def test_crafted_pickle_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    data = pickle.dumps({"json": "{}", "tensors": Evil()})
    with pytest.raises(SerializationError, match="not a valid fxrt artifact"):
        fxrt.CompiledGraph.load_artifacts(data)
    buf = io.BytesIO()
    torch.save({"json": "{}", "tensors": Evil()}, buf)
    with pytest.raises(SerializationError):
        fxrt.CompiledGraph.load_artifacts(buf.getvalue())
    assert not (tmp_path / "pwned").exists()


def _populated_cache(tmp_path):
    cfg = fxrt.CompilerConfig(cache_dir=str(tmp_path), pure_python=True)
    x = torch.randn(4, 3)
    gm = make_fx(lambda x: (x.cos() + 1).sum(0))(x)
    fxrt.compile_graph(gm, [x], cfg)
    (entry,) = cache.DiskCache(tmp_path).entries()
    return cfg, gm, x, entry


def test_cache_hit_skips_compilation(tmp_path):
    cfg, gm, x, _ = _populated_cache(tmp_path)
    before = cache.stats["compiled"]
    cg = fxrt.compile_graph(gm, [x], cfg)
    assert cache.stats["compiled"] == before
    torch.testing.assert_close(cg(x), (x.cos() + 1).sum(0))
    cfg_off = fxrt.CompilerConfig(cache_dir=str(tmp_path), cache=False)
    fxrt.compile_graph(gm, [x], cfg_off)
    assert cache.stats["compiled"] == before + 1


def test_key_depends_on_constant_values(tmp_path):
    cfg = fxrt.CompilerConfig(cache_dir=str(tmp_path))
    x = torch.randn(2, 8)
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        lin = torch.nn.Linear(8, 8)
        with torch.no_grad():
            cg = fxrt.compile_graph(make_fx(lin)(x), [x], cfg)
            outs.append((cg(x), lin(x)))
    for got, want in outs:
        torch.testing.assert_close(got, want)
    assert len(cache.DiskCache(tmp_path).entries()) == 2


@pytest.mark.parametrize(
    "damage",
    ["truncated", "corrupted", "wrong_version", "foreign", "empty"],
)
def test_bad_cache_entry_warns_is_removed_and_recompiles(tmp_path, damage):
    cfg, gm, x, entry = _populated_cache(tmp_path)
    data = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "corrupted":
        entry.write_bytes(data[:100] + bytes(b ^ 0xFF for b in data[100:300]) + data[300:])
    elif damage == "wrong_version":
        import json

        blob = torch.load(io.BytesIO(data), weights_only=True)
        doc = json.loads(blob["json"])
        doc["versions"]["torch"] = "0.0.1"
        blob["json"] = json.dumps(doc)
        buf = io.BytesIO()
        torch.save(blob, buf)
        entry.write_bytes(buf.getvalue())
    elif damage == "foreign":
        entry.write_bytes(b"#!/bin/sh\necho this is not an fxrt artifact\n")
    else:
        entry.write_bytes(b"")
    before = cache.stats["compiled"]
    with pytest.warns(UserWarning, match="fxrt cache: ignoring unusable entry"):
        cg = fxrt.compile_graph(gm, [x], cfg)
    assert cache.stats["compiled"] == before + 1  # compiled again
    torch.testing.assert_close(cg(x), (x.cos() + 1).sum(0))
    assert cache.DiskCache(tmp_path).entries() == [entry]  # and stored afresh
    fxrt.CompiledGraph.load_artifacts(entry.read_bytes())


SCRIPT = textwrap.dedent("""
    import sys, torch, fxrt
    from fxrt import cache
    from fxrt.models import DecoderBlock
    torch.manual_seed(0)
    m = DecoderBlock(32, 2).eval()
    x = torch.randn(1, 4, 32)
    with torch.no_grad():
        out = torch.compile(m, backend="fxrt")(x)
        torch.testing.assert_close(out, m(x))
    print("compiled", cache.stats["compiled"], "hit", cache.stats["hit"])
""")


def _run(tmp_path, n=1):
    env = {**os.environ, "FXRT_CACHE_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return [o.strip().splitlines()[-1] for o in outs]


def test_second_process_hits_the_cache(tmp_path):
    assert _run(tmp_path) == ["compiled 1 hit 0"]
    assert _run(tmp_path) == ["compiled 0 hit 1"]


def test_two_processes_compiling_one_key_at_once(tmp_path):
    results = _run(tmp_path, n=2)
    assert all(r.startswith("compiled") for r in results)
    (entry,) = cache.DiskCache(tmp_path).entries()
    fxrt.CompiledGraph.load_artifacts(entry.read_bytes())
    assert not [p for p in tmp_path.rglob(".tmp-*")]


def test_cache_cli(tmp_path):
    _populated_cache(tmp_path)
    run = [sys.executable, "-m", "fxrt", "cache"]
    out = subprocess.run([*run, "info", "--dir", str(tmp_path)], capture_output=True, text=True)
    assert "entries:   1" in out.stdout
    out = subprocess.run([*run, "list", "--dir", str(tmp_path)], capture_output=True, text=True)
    assert "1 entries" in out.stdout
    out = subprocess.run([*run, "clear", "--dir", str(tmp_path)], capture_output=True, text=True)
    assert "removed 1 entries" in out.stdout
    assert cache.DiskCache(tmp_path).entries() == []
