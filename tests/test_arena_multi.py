"""Several results of one call in the arena (fxrt.exec.arena): a node whose op returns several
tensors gets a slot per result, side by side, and its ``out=`` form writes them all; or, when one
of them cannot have a slot, none does.

* ATen's multi-result ops with ``out=`` kernels of their own (``max.dim``, ``topk``, ``aminmax``)
  and fxrt's fused decoder ops (``add_rms_norm``, ``rotary``, ``rotary_complex``), on both
  loops, each called on different values against eager; the profiler shows the ``out=`` form ran;
* fxrt's own ops' ``out=`` forms against their functional forms, bit for bit, on the fast path
  and off it (another dtype, a strided out), and a wrong-sized out named;
* the planner's rules: all results or none, and the verifier refuses results apart.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import native_available, recording_compiles, skip_unless_executor
from test_arena import compile_fn, loops, slotted
from torch.profiler import profile

import fxrt
from fxrt.exec.arena import out_variant
from fxrt.exec.arena_verify import ArenaError, verify_arena

aten = torch.ops.aten
needs_ops = pytest.mark.skipif(not native_available(), reason="fxrt's own ops need the extension")


def out_calls(loop, inputs, op: str, n_args: int) -> tuple[object, int]:
    """``loop(inputs)`` under the profiler, and how many calls of ``op`` took ``n_args``
    arguments (an ``out=`` form takes one more per result than the functional form)."""
    with profile(record_shapes=True) as prof:
        result = loop(inputs)
    return result, sum(e.name == op and len(e.input_shapes) == n_args for e in prof.events())


# --- ATen's multi-result ops ---------------------------------------------------------------------


def max_then_use(x):
    v, i = torch.max(x.sin(), dim=1)
    top, where = torch.topk(x.cos(), 3, dim=-1)
    lo, hi = torch.aminmax(x * 2, dim=0)
    return v.cos() + i.float(), (top * where).sum(-1), lo + hi


@pytest.mark.parametrize(
    "op, functional, n_args",
    [("aten::max", aten.max.dim, 5), ("aten::topk", aten.topk.default, 7),
     ("aten::aminmax", aten.aminmax.default, 5)],
)  # fmt: skip
def test_aten_multi_result_ops_write_their_slots(op, functional, n_args):
    assert out_variant(functional) is not None
    x = torch.randn(6, 8)
    cg = compile_fn(max_then_use, x)
    verify_arena(cg.graph, cg.plan, cg.program.arena)
    (line,) = [s for s in str(cg.program).splitlines() if f"= {op}" in s]
    assert line.count("arena[") == 2 and " via " in line, line
    for loop in loops(cg.program):
        for seed in (0, 1):
            xi = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
            got, ran = out_calls(loop, [xi], op, n_args)
            torch.testing.assert_close(got, max_then_use(xi))
            assert ran == 1, (type(loop).__name__, op)


def test_results_in_slots_all_or_none():
    # The indices leave the graph (a graph output has no slot), so the values do not get one
    # either: the out= form would write both.
    def f(x):
        v, i = torch.max(x, dim=1)
        return v.exp() + 1, i

    x = torch.randn(4, 5)
    cg = compile_fn(f, x)
    assert not any(n.startswith("max") for n in slotted(cg))
    assert "exp" in slotted(cg)
    for loop in loops(cg.program):
        xi = torch.randn(4, 5)
        torch.testing.assert_close(loop([xi]), f(xi))


def test_verifier_refuses_results_apart():
    x = torch.randn(6, 8)
    cg = compile_fn(max_then_use, x)
    arena = cg.program.arena
    names = cg.program.reg_names
    at = next(i for i, s in enumerate(arena.slots) if names[s.value] == "max_1_0")
    slots = list(arena.slots)
    slots[at], slots[at + 1] = slots[at + 1], slots[at]
    with pytest.raises(ArenaError, match="not in slots side by side"):
        verify_arena(cg.graph, cg.plan, dataclasses.replace(arena, slots=tuple(slots)))


# --- fxrt's fused decoder ops ------------------------------------------------------------------


def own(name: str):
    fxrt.runtime_info()  # loads the extension, which registers the ops
    return getattr(torch.ops.fxrt, name)


def rms_eager(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_eager(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


def complex_eager(x, f):
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * f).flatten(-2)


def piece_eager(x, res, w, q, k, cos, sin, freqs):
    """The three chains fxrt fuses into multi-result ops, each result read by a later op (so
    every result gets a slot)."""
    summed = x + res
    normed = rms_eager(summed, w)
    qr, kr = rope_eager(q, cos, sin), rope_eager(k, cos, sin)
    qc, kc = complex_eager(q, freqs), complex_eager(k, freqs)
    return normed.sum(-1) + summed.mean(-1), (qr @ kr.transpose(-1, -2)).exp(), qc.sin() * kc


def piece_inputs(seed: int, transposed: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(2, 5, 32, generator=g) for _ in range(2))
    w = torch.randn(32, generator=g)
    if transposed:  # [B, S, H, D] -> [B, H, S, D], as attention's heads are split
        q, k = (torch.randn(2, 5, 4, 16, generator=g).transpose(1, 2) for _ in range(2))
    else:
        q, k = (torch.randn(2, 4, 5, 16, generator=g) for _ in range(2))
    angle = torch.rand(5, 16, generator=g) * 6
    freqs = torch.polar(torch.ones(5, 8), angle[:, :8])
    return [x, res, w, q, k, angle.cos(), angle.sin(), freqs]


def compiled_piece(executor: str, transposed: bool):
    """piece_eager through torch.compile on ``executor``: its fused calls and its program."""
    skip_unless_executor(executor)
    torch._dynamo.reset()
    # every slot kept: on these small tensors the arena's peak rule (tests/test_arena_peak.py)
    # gives some back, and the test is about the slots the fused ops write
    options = {"pure_python": executor == "python", "arena_headroom": math.inf}
    compiled = torch.compile(piece_eager, backend="fxrt", options=options)
    with recording_compiles() as built, torch.no_grad():
        compiled(*piece_inputs(0, transposed))
    (cg,) = built
    # A complex product reshapes its operand: on transposed heads that is a copy, which
    # rotary_complex's pattern does not claim (models rotate [B, S, H, D] before the transpose).
    fused = ["add_rms_norm", "rotary"] + ([] if transposed else ["rotary_complex"])
    assert fxrt.pattern_counts(cg) == dict.fromkeys(fused, 1)
    return compiled, cg, fused


@needs_ops
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "heads_transposed"])
def test_fused_ops_write_their_slots(transposed, executor):
    compiled, cg, fused = compiled_piece(executor, transposed)
    verify_arena(cg.graph, cg.plan, cg.program.arena)
    listing = str(cg.program)
    for op in fused:
        (line,) = [s for s in listing.splitlines() if f"= fxrt::{op}(" in s]
        assert line.count("arena[") == 2 and f"via fxrt::{op}.out" in line, line
    for seed in (1, 2):
        inputs = piece_inputs(seed, transposed)
        with profile(record_shapes=True) as prof, torch.no_grad():
            got = compiled(*inputs)
        torch.testing.assert_close(got, piece_eager(*inputs), rtol=2e-5, atol=2e-5)
        shapes = {e.name: len(e.input_shapes) for e in prof.events() if "fxrt::" in e.name}
        # each out= form: its functional form's arguments and one per result
        n_args = {"add_rms_norm": 8, "rotary": 8, "rotary_complex": 5}
        assert shapes == {f"fxrt::{op}": n_args[op] for op in fused}, shapes


@needs_ops
def test_both_loops_agree_bit_for_bit_on_the_fused_ops():
    if not native_available():
        pytest.skip("the compiled loop is not built")
    inputs = piece_inputs(3)
    results = []
    for executor in ("python", "cpp"):
        compiled, _, _ = compiled_piece(executor, False)
        with torch.no_grad():
            results.append(compiled(*inputs))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _strided_like(t: torch.Tensor) -> torch.Tensor:
    """An out of ``t``'s sizes whose rows are not dense (every other element of a wider one)."""
    return torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["dense", "strided"])
def test_out_forms_equal_the_functional_forms(dtype, layout):
    # float32/bfloat16 dense: the fast path into the out tensors; float64 or a strided out: the
    # functional op's results copied in.
    x, res, w, q, k, cos, sin, freqs = (t.to(dtype) if not t.is_complex() else t
                                        for t in piece_inputs(4))  # fmt: skip
    cases = [
        ("rms_norm", (x, w, 1e-6), ("out",)),
        ("gated", (x, res), ("out",)),
        ("add_rms_norm", (x, res, w, 1e-6), ("out", "residual_out")),
        ("rotary", (q, k, cos, sin), ("q_out", "k_out")),
        ("rotary_complex", (q, k, freqs), ("q_out", "k_out")),
    ]
    for name, args, written in cases:
        if name == "rotary_complex" and dtype is torch.float64:
            continue  # the complex product of float64 pairs needs complex128 frequencies
        want = own(name)(*args)
        want = want if isinstance(want, tuple) else (want,)
        outs = [torch.empty_like(t) if layout == "dense" else _strided_like(t) for t in want]
        got = getattr(torch.ops.fxrt, name).out(*args, **dict(zip(written, outs)))
        got = got if isinstance(got, tuple) else (got,)
        for g, o, wt in zip(got, outs, want, strict=True):
            assert g.data_ptr() == o.data_ptr()
            torch.testing.assert_close(o, wt, rtol=0, atol=0)


@needs_ops
def test_out_forms_name_a_wrong_sized_out():
    x, res, w, q, k, cos, sin, freqs = piece_inputs(5)
    small = torch.empty(2, 5, 31)
    sizes = r"add_rms_norm.out: an out tensor has sizes \[2, 5, 31\]"
    with pytest.raises(RuntimeError, match=sizes):
        own("add_rms_norm").out(x, res, w, 1e-6, out=small, residual_out=torch.empty_like(x))
    with pytest.raises(RuntimeError, match=r"fxrt::rotary.out: an out tensor has sizes"):
        own("rotary").out(q, k, cos, sin, q_out=torch.empty(1), k_out=torch.empty_like(k))
    with pytest.raises(RuntimeError, match=r"rotary_complex.out: an out tensor has sizes"):
        own("rotary_complex").out(q, k, freqs, q_out=torch.empty_like(q), k_out=torch.empty(3))
