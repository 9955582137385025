"""Arena slots handed over in place (fxrt.exec.inplace): a pointwise op's result written over an
operand that dies at it. Which hand-overs the planner makes and refuses, that the verifier
rejects a forged one, and that both loops give eager's results with them, call after call."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from conftest import native_available, run_child, skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.exec.arena_verify import ArenaError, verify_arena
from fxrt.exec.interp import PythonLoop


def compile_fn(fn, *inputs, **config):
    gm = make_fx(fn)(*inputs)
    return fxrt.compile_graph(gm, list(inputs), fxrt.CompilerConfig(cache=False, **config))


def loops(program):
    out = [PythonLoop(program)]
    if native_available():
        from fxrt.exec.native import NativeLoop

        out.append(NativeLoop(program))
    return out


def hand_overs(cg) -> dict[str, str]:
    """Slot value -> the value whose slot it took over, by name."""
    names = cg.program.reg_names
    slots = cg.program.arena.slots
    return {names[s.value]: names[s.takes_over] for s in slots if s.takes_over >= 0}


def planned(fn, make_inputs) -> dict[str, str]:
    """``fn`` compiled on ``make_inputs()``, checked against eager on both loops: its
    hand-overs."""
    cg = compile_fn(fn, *make_inputs())
    agree_with_eager(cg, fn, make_inputs)
    return hand_overs(cg)


def agree_with_eager(cg, fn, make_inputs):
    """Both loops, three calls with different inputs, against eager (the arena is reused from
    call to call, so a value written over too early would show)."""
    for loop in loops(cg.program):
        for seed in range(3):
            torch.manual_seed(seed)
            inputs = make_inputs()
            torch.testing.assert_close(loop(list(inputs)), fn(*inputs), rtol=1e-5, atol=1e-5)


def mlp(x, w1, w2, b):
    h = torch.nn.functional.gelu(x @ w1 + b)  # add over mm, gelu over add
    y = (h * 2.0).tanh()  # mul over gelu, tanh over mul
    return (y @ w2).sum(-1)


def mlp_inputs():
    return torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16), torch.randn(32)


def test_a_pointwise_chain_keeps_one_slot():
    cg = compile_fn(mlp, *mlp_inputs())
    assert hand_overs(cg) == {"add": "mm", "gelu": "add", "mul": "gelu", "tanh": "mul"}
    slots = {cg.program.reg_names[s.value]: s for s in cg.program.arena.slots}
    assert len({slots[n].offset for n in ("mm", "add", "gelu", "mul", "tanh")}) == 1
    # The chain is 1 KiB; the second matmul's result (512 bytes) is live only after it.
    assert cg.program.arena.nbytes == 1024 + 512
    verify_arena(cg.graph, cg.plan, cg.program.arena)
    assert "(in place of %mm)" in cg.program.arena.text(cg.program.reg_names)
    agree_with_eager(cg, mlp, mlp_inputs)


def test_no_hand_over_where_the_elements_are_not_the_same():
    def f(x, w):
        r = x @ w
        e = r.exp()  # r dies here, but e is read again below: exp takes over r, sin not e
        s = e.sin()
        half = (s * e)[:4].cos()  # a view of half the storage: cos may not write over it
        soft = torch.softmax(half, -1)  # not pointwise
        wide = half.double() + 1  # another dtype
        return soft.sum() + wide.sum()

    inputs = lambda: (torch.randn(8, 8), torch.randn(8, 8))  # noqa: E731
    assert planned(f, inputs) == {"exp": "mm", "mul": "sin"}


def test_a_transposed_operand_is_written_over_with_its_own_strides():
    def f(x, w):
        t = (x @ w).t()  # a view of the whole storage; the sin keeps its strides
        return (t.sin() * 3).sum(0)

    inputs = lambda: (torch.randn(6, 4), torch.randn(4, 6))  # noqa: E731
    assert planned(f, inputs) == {"sin": "mm", "mul": "sin"}


def test_the_verifier_rejects_a_forged_hand_over():
    def f(x, w):
        r = x @ w
        return torch.softmax(r, -1).sum(0)

    cg = compile_fn(f, torch.randn(4, 4), torch.randn(4, 4))
    arena = cg.program.arena
    names = cg.program.reg_names
    mm, soft = (next(s for s in arena.slots if names[s.value] == n) for n in ("mm", "_softmax"))
    forged = dataclasses.replace(soft, offset=mm.offset, takes_over=mm.value)
    slots = tuple(forged if s is soft else s for s in arena.slots)
    with pytest.raises(ArenaError, match="does not read element for element"):
        verify_arena(cg.graph, cg.plan, dataclasses.replace(arena, slots=slots))


@pytest.mark.skipif(not native_available(), reason="fxrt's own ops need the compiled extension")
def test_the_gated_product_takes_over_its_gate():
    def f(x, w1, w2, w3):
        return (torch.nn.functional.silu(x @ w1) * (x @ w2)) @ w3

    inputs = lambda: (
        torch.randn(8, 16),
        torch.randn(16, 64),
        torch.randn(16, 64),
        torch.randn(64, 16),
    )  # noqa: E731,E501
    cg = compile_fn(f, *inputs())
    assert fxrt.pattern_counts(cg).get("gated_mlp") == 1
    taken = hand_overs(cg)
    assert [k for k in taken if k.startswith("fused_gated")], taken
    agree_with_eager(cg, f, inputs)


WARM = """
    import json, sys, torch, fxrt
    import torch.nn.functional as F
    from conftest import recording_compiles

    dtype = getattr(torch, sys.argv[1])

    def mlp(x, w1, w2, w3):  # a pointwise chain and a gated product: hand-overs in the arena
        h = F.gelu(x @ w1) * 2.0
        return (F.silu(h @ w2) * (h @ w3)).sum(-1)

    f = torch.compile(mlp, backend="fxrt")
    with recording_compiles() as built, torch.no_grad():
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            shapes = ((4, 16), (16, 32), (32, 32), (32, 32))
            args = [torch.randn(s, generator=g).to(dtype) for s in shapes]
            tol = 1e-5 if dtype is torch.float32 else 2e-2
            torch.testing.assert_close(f(*args), mlp(*args), rtol=tol, atol=tol)
    arena = built[0].program.arena
    names = built[0].program.reg_names
    slots = [(names[s.value], s.offset, names[s.takes_over] if s.takes_over >= 0 else None)
             for s in arena.slots]
    print(json.dumps({"slots": slots, "counts": fxrt.pattern_counts(built[0]),
                      "stats": dict(fxrt.cache.stats)}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_warm_second_process_gets_the_same_hand_overs(executor, dtype, tmp_path):
    """A cold process, then a warm one on the same cache directory: the hit's arena has the
    miss's slots and hand-overs, its fused ops the miss's counts, and both equal eager."""
    skip_unless_executor(executor)
    env = {"PYTHONPATH": os.path.dirname(__file__)}
    cold = run_child(WARM, tmp_path, executor, dtype, env=env)
    warm = run_child(WARM, tmp_path, executor, dtype, env=env)
    assert cold["stats"].get("hit", 0) == 0 and warm["stats"].get("hit", 0) >= 1, (cold, warm)
    assert warm["slots"] == cold["slots"] and any(s[2] for s in cold["slots"]), (cold, warm)
    assert warm["counts"] == cold["counts"], (cold, warm)
    if native_available():
        assert cold["counts"] == {"gated_mlp": 1}, cold
