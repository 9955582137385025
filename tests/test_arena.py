"""The arena (fxrt.exec.arena): which values get a slot, that slots live together never overlap,
and that both loops give eager's results with it in every situation where a call must run
without it (autograd, other input sizes, a failing out= kernel) and across calls, modes and
threads."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import LoggingDispatchMode, native_available, run_in_threads
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.exec.arena import out_variant
from fxrt.exec.arena_verify import ArenaError, verify_arena
from fxrt.exec.interp import PythonLoop
from fxrt.exec.memory import memory_report
from fxrt.exec.program import Call

aten = torch.ops.aten


def loops(program):
    """The Python loop and, when built, the compiled loop, for ``program``."""
    out = [PythonLoop(program)]
    if native_available():
        from fxrt.exec.native import NativeLoop

        out.append(NativeLoop(program))
    return out


def compile_fn(fn, *inputs, **config):
    gm = make_fx(fn)(*inputs)
    return fxrt.compile_graph(gm, list(inputs), fxrt.CompilerConfig(cache=False, **config))


def chain(x, w):
    a = torch.sin(x @ w)
    b = torch.relu(a + 1.0)
    c = torch.cos(b) * a
    return c.sum(0), torch.tanh(c)


def slotted(cg) -> set[str]:
    """Names of the values that have an arena slot."""
    names = cg.program.reg_names
    return {names[s.value] for s in cg.program.arena.slots}


def test_intermediates_get_slots_outputs_and_views_do_not():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    cg = compile_fn(chain, x, w)
    assert slotted(cg) == {"mm", "sin", "add", "relu", "cos", "mul"}
    listing = str(cg.program)
    assert "arena  " in listing and "via aten::sin.out" in listing
    assert "aten::relu(%add) -> arena" in listing and "clamp_min.out(%add, 0, out=%relu)" in listing
    verify_arena(cg.graph, cg.plan, cg.program.arena)
    # Six 64-byte values, at most three live at once, in two chains written over in place (sin
    # over mm; relu over add, cos over relu, mul over cos: fxrt.exec.inplace), so two slots.
    assert cg.program.arena.nbytes == 128


def test_arena_off_gives_the_plain_program():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    cg = compile_fn(chain, x, w, arena=False)
    assert cg.program.arena is None and "arena" not in str(cg.program)
    for loop in loops(cg.program):
        torch.testing.assert_close(loop([x, w]), chain(x, w))


def test_random_ops_and_outputs_keep_their_functional_call():
    def f(x):
        noise = torch.rand(4, 4) * 0  # random: its generator draws must stay eager's
        return (x.exp() + noise).sum()

    cg = compile_fn(f, torch.randn(4, 4))
    assert "exp" in slotted(cg)
    assert not any(n.startswith("rand") for n in slotted(cg))
    assert out_variant(aten.rand.default) is None
    assert out_variant(aten.exp.default) is aten.exp.out
    assert out_variant(aten.relu.default) is None  # its own out= is a generated copy


def test_verifier_rejects_overlapping_live_slots():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    cg = compile_fn(chain, x, w)
    arena = cg.program.arena
    a, b = arena.slots[0], arena.slots[1]  # mm and sin: sin is made while mm is live
    assert a.first <= b.last and b.first <= a.last
    broken = dataclasses.replace(
        arena,
        slots=(a, dataclasses.replace(b, offset=a.offset, takes_over=-1), *arena.slots[2:]),
    )
    with pytest.raises(ArenaError, match="live together and overlap"):
        verify_arena(cg.graph, cg.plan, broken)
    misaligned = dataclasses.replace(arena, slots=(dataclasses.replace(a, offset=4),))
    with pytest.raises(ArenaError, match="misplaced"):
        verify_arena(cg.graph, cg.plan, misaligned)


def test_many_calls_reuse_the_arena_and_never_touch_earlier_results():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    cg = compile_fn(chain, x, w)
    for loop in loops(cg.program):
        results, expected = [], []
        for i in range(5):
            xi = x + i
            results.append(loop([xi, w]))
            expected.append(chain(xi, w))
        torch.testing.assert_close(results, expected)
    py = loops(cg.program)[0]
    py([x, w])
    first = py._pools[(False, None)][0]
    py([x, w])
    assert py._pools[(False, None)] == [first]  # the same arena, back in the pool


def test_views_of_slots_use_absolute_storage_offsets():
    # b lives after a in the arena; as_strided's storage offset is absolute, so b's tensor
    # must start its own storage.
    def f(x):
        a = x.sin()
        b = x.cos()
        return aten.as_strided(b, (2, 2), (2, 1), 1) + a[:2, :2]

    x = torch.randn(4, 4)
    cg = compile_fn(f, x)
    assert {"sin", "cos"} <= slotted(cg)
    for loop in loops(cg.program):
        torch.testing.assert_close(loop([x]), f(x))


def test_autograd_calls_run_without_the_arena():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    cg = compile_fn(chain, x, w)
    for loop in loops(cg.program):
        xg = x.clone().requires_grad_()
        s, t = loop([xg, w])
        assert s.requires_grad and t.requires_grad
        (s.sum() + t.sum()).backward()
        xe = x.clone().requires_grad_()
        es, et = chain(xe, w)
        (es.sum() + et.sum()).backward()
        torch.testing.assert_close(xg.grad, xe.grad)
        with torch.no_grad():
            torch.testing.assert_close(loop([xg, w]), chain(x, w))


def test_inputs_of_other_sizes_or_dtypes_run_without_the_arena():
    def f(x):
        return (x.sin() * 2).cos().sum()

    cg = compile_fn(f, torch.randn(4, 4), check_inputs=False)  # the arena's own guard
    assert cg.program.arena is not None
    for loop in loops(cg.program):
        for x in (torch.randn(8, 3), torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4)):
            torch.testing.assert_close(loop([x]), f(x))


def test_inference_and_normal_mode_each_get_their_own_arena():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    cg = compile_fn(chain, x, w)
    for loop in loops(cg.program):
        for mode in ("inference", "no_grad", "inference", "normal"):
            if mode == "inference":
                with torch.inference_mode():
                    got = loop([x, w])
            elif mode == "no_grad":
                with torch.no_grad():
                    got = loop([x, w])
            else:
                got = loop([x, w])
            torch.testing.assert_close(got, chain(x, w))


def test_a_failing_out_kernel_falls_back_to_the_plain_call():
    # Slots of the wrong dtype: every out= kernel refuses its slot, so each call runs its
    # plain form.
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="can't be cast"):
        aten.sin.out(x, out=torch.empty(4, 4, dtype=torch.int32))
    cg = compile_fn(chain, x, w)
    arena = cg.program.arena
    bad = dataclasses.replace(
        arena, slots=tuple(dataclasses.replace(s, dtype=torch.int32) for s in arena.slots)
    )
    program = dataclasses.replace(cg.program, arena=bad)
    assert any(isinstance(i, Call) and i.slot >= 0 for i in program.code)
    for loop in loops(program):
        torch.testing.assert_close(loop([x, w]), chain(x, w))


@pytest.mark.skipif(not native_available(), reason="the compiled loop is not built")
def test_threads_each_get_an_arena():
    from fxrt.exec.native import NativeLoop

    x, w = torch.randn(16, 16), torch.randn(16, 16)
    loop = NativeLoop(compile_fn(chain, x, w).program)

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(50):
            a = torch.randn(16, 16, generator=gen)
            torch.testing.assert_close(loop([a, w]), chain(a, w))

    run_in_threads(work)


def test_memory_report_names_the_arena():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    cg = compile_fn(chain, x, w)
    report = memory_report(cg, [x, w])
    assert report.arena_bytes == 128 and report.arena_values == 6  # two chains in place
    assert "arena: 128 bytes, held between calls, serving 6 of these values" in report.text()
    assert list(report.measured) == list(report.planned)


def test_views_read_only_inside_the_graph_are_made_inline():
    def f(x, w):
        a = (x @ w.t()).view(2, 2, 4)  # t of an input, view of a result
        b = a.transpose(-1, 0).permute(2, 0, 1).sum(0)  # negative and permuted dims
        c = torch.ones(5).t() * 2  # t of a 1-d tensor is itself
        d = x.view(-1)  # returned: stays a real view
        e = (x * 1).transpose(0, 1)
        e.add_(1)  # written: stays a real view
        return b, c, d, e

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    cg = compile_fn(f, x, w)
    listing = str(cg.program)
    inline = {line.split("=")[0].split()[-1] for line in listing.splitlines() if "(inline)" in line}
    assert {"%t", "%view", "%transpose", "%permute"} <= inline
    assert not {"%view_1", "%transpose_1"} & inline, listing
    for loop in loops(cg.program):
        for ctx in (torch.inference_mode, torch.no_grad, torch.enable_grad):
            with ctx():
                got = loop([x.clone(), w.clone()])
                want = f(x.clone(), w.clone())
            torch.testing.assert_close(got, want)
            # the returned view is a view of its input exactly as in eager
            assert (got[2]._base is None) == (want[2]._base is None)


def test_split_pieces_read_only_inside_the_graph_are_made_inline():
    def f(x, w):
        q, k, v = (x @ w).split(3, -1)  # a projection split in three (an attention's qkv)
        a, b = x.split(3)  # along dim 0: uneven pieces (3 and 1 rows)
        c, d = (x * 2).split(3, 1)
        c.mul_(3)  # a piece written: the split stays a real call
        return q * k + v, a.sum(0) + b.sum(0), c, d.sum()

    x, w = torch.randn(4, 6), torch.randn(6, 9)
    cg = compile_fn(f, x, w)
    listing = str(cg.program)
    splits = [line for line in listing.splitlines() if "aten::split.Tensor" in line]
    assert len(splits) == 3, listing
    assert "(inline)" in splits[0] and "(inline)" in splits[1] and "(inline)" not in splits[2]
    for loop in loops(cg.program):
        for ctx in (torch.inference_mode, torch.no_grad, torch.enable_grad):
            for xs in (x, torch.randn(4, 6)):  # two calls, other values
                with ctx():
                    got = loop([xs.clone(), w.clone()])
                    want = f(xs.clone(), w.clone())
                torch.testing.assert_close(got, want)


def test_dispatch_modes_see_the_graphs_own_ops():
    # No out= forms, inline views or inline allocations under a TorchDispatchMode.
    def f(x, w):
        buf = aten.empty_strided.default([4, 4], [4, 1], dtype=torch.float32)
        torch.sin(x, out=buf)
        fresh = aten.empty_strided.default([2], [1], dtype=torch.float32)
        return torch.mm(buf, w.t()).sum(0), fresh

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    cg = compile_fn(f, x, w)
    assert "(inline)" in str(cg.program) and "arena[" in str(cg.program)
    for loop in loops(cg.program):
        with torch.inference_mode(), LoggingDispatchMode() as mode:
            got = loop([x, w])
        torch.testing.assert_close(got[0], f(x, w)[0])
        assert mode.seen == [
            "aten.empty_strided.default",
            "aten.sin.out",
            "aten.empty_strided.default",
            "aten.t.default",
            "aten.mm.default",
            "aten.sum.dim_IntList",
        ]


@pytest.mark.parametrize("split", ["unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk"])
def test_unsafe_split_pieces_keep_their_base_slot(executor, split):
    """``unsafe_split`` (what GRUCell's decomposition and Dynamo graphs call) returns views whose
    schema says nothing of it: its pieces were not in their base's alias set, the base's slot was
    freed while they were read, and the next addmm wrote over them."""
    from conftest import check_against_eager

    def pieces(x):
        if split == "unsafe_split":
            return aten.unsafe_split.Tensor(x, 4, 1)
        if split == "unsafe_split_with_sizes":
            return aten.unsafe_split_with_sizes.default(x, [4, 4, 4], 1)
        return aten.unsafe_chunk.default(x, 3, 1)

    def fn(x, h, w1, w2):
        a, b, c = pieces(x @ w1)
        d, e, f = pieces(h @ w2)  # reuses the first product's bytes once that is free
        return (a * d + b * e + c * f).sum(0)

    args = (torch.randn(2, 5), torch.randn(2, 5), torch.randn(5, 12), torch.randn(5, 12))
    with torch.inference_mode():
        check_against_eager(fn, args, executor, options={"cache": False})
    torch.manual_seed(0)
    cell = torch.nn.GRUCell(8, 8).eval()
    with torch.inference_mode():
        check_against_eager(cell, (torch.randn(1, 8), torch.randn(1, 8)), executor)
