"""The compile cache for Dynamo graphs with symbolic sizes: keyed before fxrt's ATen trace with
the shape environment's facts, the trace's guards stored and replayed on a hit
(:mod:`fxrt.shapefacts`). A hit must leave Dynamo's guards exactly as the miss did."""

from __future__ import annotations

import pytest
import torch
from conftest import EXECUTORS, run_child, skip_unless_executor

from fxrt import cache
from fxrt.shapefacts import ShapeFacts, from_text, to_text

CHILD = """
    import json, sys, torch, fxrt
    from fxrt.models import KVCacheDecoder
    torch.manual_seed(0)

    def split_sum(x):  # its ATen trace adds guards of its own: Ne(s // 2, 1), Eq(s, 2 * (s // 2))
        return x.unflatten(-1, (2, -1)).sum(-1) + torch.diff(x, dim=-1).sum()

    guards = []

    def spy(gm, example_inputs, **kw):  # fxrt's backend, then the shape guards Dynamo holds
        out = fxrt.backend(gm, example_inputs, **kw)
        env = torch._guards.detect_fake_mode(example_inputs).shape_env
        guards.append(sorted(str(g.expr) for g in env.guards))
        return out

    torch.manual_seed(int(sys.argv[1]))
    f = torch.compile(split_sum, backend=spy, dynamic=True)
    for n in (8, 12, 6):
        x = torch.randn(1, 2, n)
        torch.testing.assert_close(f(x), split_sum(x))
    model = KVCacheDecoder().eval()
    m = torch.compile(model, backend=spy, dynamic=True)
    with torch.no_grad():
        for b, s in ((1, 3), (2, 5), (1, 7)):
            x = torch.randn(b, s, 32)
            caches = [torch.zeros(2, b, 2, 16, 16) for _ in range(2)]
            expect = [c.clone() for c in caches]
            pos = torch.arange(s)
            torch.testing.assert_close(m(x, *caches, pos), model(x, *expect, pos))
            torch.testing.assert_close(caches, expect)
    print(json.dumps({**fxrt.cache.stats, "guards": guards}))
"""


@pytest.mark.parametrize("executor", EXECUTORS)
def test_dynamic_graphs_hit_before_the_trace_in_a_second_process(tmp_path, executor):
    skip_unless_executor(executor)
    cold = run_child(CHILD, tmp_path, executor, "1")
    assert cold.get("stored", 0) >= 2 and cold.get("hit", 0) == 0, cold
    warm = run_child(CHILD, tmp_path, executor, "2")  # other inputs
    assert warm.get("hit", 0) == cold["stored"] and warm.get("compiled", 0) == 0, warm
    assert warm.get("rejected", 0) == 0, warm
    # The hit left Dynamo's shape guards exactly as the trace did (the trace's own included).
    assert warm["guards"] == cold["guards"], (cold["guards"], warm["guards"])
    assert any("//2" in g for g in cold["guards"][0]), cold["guards"]


def _split_sum(x):
    return x.unflatten(-1, (2, -1)).sum(-1) + torch.diff(x, dim=-1).sum()


def _scaled_sum(x):
    return (x * 2).sum(-1)


def _compile_dynamic(tmp_path, x, fn=_split_sum, **marks):
    torch._dynamo.reset()
    if marks:
        torch._dynamo.mark_dynamic(x, 2, **marks)
    opts = {"cache_dir": str(tmp_path)}
    f = torch.compile(fn, backend="fxrt", dynamic=None if marks else True, options=opts)
    before = dict(cache.stats)
    torch.testing.assert_close(f(x), fn(x))
    return {k: cache.stats[k] - before.get(k, 0) for k in ("hit", "miss", "stored")}


def test_symbol_ranges_are_in_the_key(tmp_path):
    x = torch.randn(1, 2, 8)
    assert _compile_dynamic(tmp_path, x, _scaled_sum, min=2, max=64)["stored"] == 1
    assert _compile_dynamic(tmp_path, x.clone(), _scaled_sum, min=2, max=64)["hit"] == 1
    # Another range: the trace may answer otherwise.
    assert _compile_dynamic(tmp_path, x.clone(), _scaled_sum, min=2, max=128)["miss"] == 1


def test_an_entry_whose_guards_fail_here_is_a_miss(tmp_path, monkeypatch):
    x = torch.randn(1, 2, 8)
    assert _compile_dynamic(tmp_path, x)["stored"] == 1
    monkeypatch.setattr(ShapeFacts, "admits", lambda self, texts: False)
    assert _compile_dynamic(tmp_path, x.clone()) == {"hit": 0, "miss": 1, "stored": 1}


def _env_with(hint: int):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    sym = env.create_symbol(hint, ConstantSource("n"), dynamic_dim=DimDynamic.DYNAMIC)
    return env, sym


def test_guard_text_round_trips_and_decides_by_the_sizes():
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod

    env, s = _env_with(8)
    guards = [sympy.Ne(FloorDiv(s, 2), 1), sympy.Eq(Mod(s, 2), 0), s > 3, sympy.Or(s < 2, s > 5)]
    texts = [to_text(g) for g in guards]
    symbols = {str(s): s}
    assert [from_text(t, symbols) for t in texts] == guards
    assert ShapeFacts(env).admits(texts)
    other, s2 = _env_with(2)  # the same symbol name, another size: Ne(2 // 2, 1) is false
    assert str(s2) == str(s)
    assert not ShapeFacts(other).admits(texts[:1])
    n = len(env.guards)
    ShapeFacts(env).replay(texts[:2])
    assert len(env.guards) > n  # recorded as the trace records them


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('echo pwned')",
        "s0.__class__",
        "Integer(1)[0]",
        "open(s0)",
        "Symbol('s0')",
        "lambda: 1",
        "s9 + 1",  # a symbol this shape environment does not have
        "x" * 5000,
    ],
)
def test_guard_text_outside_the_grammar_is_refused(text):
    env, s = _env_with(8)
    with pytest.raises(ValueError):
        from_text(text, {str(s): s})


def _forge_guards(tmp_path, guards) -> None:
    """Replace the stored shape guards of the one entry, re-hashed so the edit reaches the
    reader."""
    import hashlib
    import json

    from fxrt.artifact import MAGIC, unpack
    from fxrt.cache.store import Store

    store = Store(tmp_path)
    (key,) = store.index()
    data, record = store.read(key)
    doc, section = unpack(data)
    doc["shape_guards"] = guards
    js = json.dumps(doc).encode()
    body = len(js).to_bytes(8, "little") + js + bytes(section.data)
    record["sha256"] = hashlib.sha256(body).hexdigest()
    store.write(key, MAGIC + record["sha256"].encode() + b"\n" + body, {}, record)


HOSTILE_GUARDS = [
    ["__import__('os').system('touch pwned')"],
    "Equality(s53, Integer(8))",  # not a list
    [None],
    [7],
    ["Equality(s53, Integer(8)"],  # unbalanced
    ["Equality(s99, Integer(8))"],  # another symbol
    ["Integer(1)"],  # not a condition
    ["Equality(s53, Integer(8))"] * 10_000,
    [{"ref": 0}],
]


@pytest.mark.parametrize("guards", HOSTILE_GUARDS, ids=range(len(HOSTILE_GUARDS)))
def test_forged_shape_guards_never_run_code_or_give_a_wrong_answer(tmp_path, guards):
    import warnings

    x = torch.randn(1, 2, 8)
    assert _compile_dynamic(tmp_path, x)["stored"] == 1
    _forge_guards(tmp_path, guards)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unusable entry warns; a miss does not
        counts = _compile_dynamic(tmp_path, torch.randn(1, 2, 8))  # the answer is checked there
    assert counts["hit"] + counts["miss"] == 1
    assert not list(tmp_path.glob("**/pwned"))


def test_logging_says_which_level_hit_and_how_long_it_took(tmp_path, caplog):
    x = torch.randn(1, 2, 8)
    _compile_dynamic(tmp_path, x)
    with caplog.at_level("INFO", logger="fxrt"):
        _compile_dynamic(tmp_path, x.clone())
    (line,) = [r.getMessage() for r in caplog.records if "hit" in r.getMessage()]
    assert "before the ATen trace" in line and " ms" in line, line
