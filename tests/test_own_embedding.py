"""``fxrt::embedding`` (fxrt/_speedups/own_embedding.h): ``aten::embedding``'s rows copied
directly, on both loops. The result must be eager's bytes in every dtype and layout it takes,
eager's error for an index out of range, and the ATen op itself off its fast path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import LoggingDispatchMode
from test_own_ops import compiled

from fxrt.ops import own_ops

pytestmark = pytest.mark.skipif(
    not own_ops.available(), reason="fxrt's own ops come with the compiled extension"
)


def lookup(w, ids):
    return F.embedding(ids, w)


def lookup_scaled(w, ids):
    # The rows feed another op, so the arena holds them (fxrt::embedding.out).
    return F.embedding(ids, w) * 2.0


def ids_for(rows, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, rows, shape, generator=g, dtype=dtype)


def weights(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, width, generator=g) * 100
    return w.to(dtype) if dtype.is_floating_point else (w * 1000).to(dtype)


def run_both(fn, w, ids, other):
    """``fn`` compiled on each loop and called on ``(w, ids)`` and ``(w, other)``: each result
    equals eager's bit for bit (and so the loops agree); returns the compiled graphs."""
    graphs = []
    for executor in ("python", "cpp"):
        cg = compiled(fn, (w, ids), executor)
        for x in (ids, other):
            got, want = cg(w, x), fn(w, x)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert got.stride() == want.stride()
        graphs.append(cg)
    return graphs


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_rows_are_eagers_in_any_dtype(dtype, index_dtype):
    w = weights(128, 64, dtype)
    ids, other = ids_for(128, (2, 16), index_dtype, 1), ids_for(128, (2, 16), index_dtype, 2)
    for cg in run_both(lookup, w, ids, other):
        assert "fxrt::embedding(" in str(cg.program)


@pytest.mark.parametrize("shape", [(), (5,), (1, 16), (2, 3, 4), (0,), (3, 0)])
def test_index_shapes(shape):
    w = weights(50, 24, torch.float32)
    run_both(lookup, w, ids_for(50, shape, torch.int64, 3), ids_for(50, shape, torch.int64, 4))


def test_the_arena_holds_the_rows_and_they_survive_the_next_call():
    w = weights(128, 64, torch.float32)
    ids, other = ids_for(128, (1, 16), torch.int64, 5), ids_for(128, (1, 16), torch.int64, 6)
    for cg in run_both(lookup_scaled, w, ids, other):
        assert "via fxrt::embedding.out" in str(cg.program)
        first = cg(w, ids)
        kept = first.clone()
        cg(w, other)
        torch.testing.assert_close(first, kept, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda w: w[:, :40], id="rows-of-a-column-slice"),  # rows contiguous, step 64
        pytest.param(lambda w: w.t().contiguous().t(), id="column-major"),  # rows strided: ATen
        pytest.param(lambda w: w[::2], id="every-other-row"),
    ],
)
def test_weight_layouts(make):
    w = make(weights(128, 64, torch.float32))
    rows = w.shape[0]
    run_both(
        lookup, w, ids_for(rows, (3, 7), torch.int64, 7), ids_for(rows, (3, 7), torch.int64, 8)
    )


def test_non_contiguous_indices_are_eagers():
    w = weights(128, 64, torch.float32)
    ids = ids_for(128, (16, 4), torch.int64, 9).t()
    run_both(lookup, w, ids, ids_for(128, (16, 4), torch.int64, 10).t())


@pytest.mark.parametrize("executor", ["python", "cpp"])
@pytest.mark.parametrize("bad", [128, -1, 10**9])
def test_an_index_out_of_range_is_eagers_error(executor, bad):
    w = weights(128, 64, torch.float32)
    ids = ids_for(128, (1, 16), torch.int64, 11)
    cg = compiled(lookup_scaled, (w, ids), executor)
    ids_bad = ids.clone()
    ids_bad[0, 7] = bad
    with pytest.raises(IndexError, match="index out of range in self"):
        lookup_scaled(w, ids_bad)
    with pytest.raises(Exception, match="index out of range in self"):
        cg(w, ids_bad)
    torch.testing.assert_close(cg(w, ids), lookup_scaled(w, ids), rtol=0, atol=0)


@pytest.mark.parametrize("executor", ["python", "cpp"])
def test_under_autograd_it_is_atens(executor):
    w = weights(32, 8, torch.float32)
    ids = ids_for(32, (2, 5), torch.int64, 12)
    cg = compiled(lookup, (w, ids), executor)
    got_w = w.clone().requires_grad_()
    got = cg(got_w, ids)
    assert got.requires_grad
    got.pow(2).sum().backward()
    want_w = w.clone().requires_grad_()
    lookup(want_w, ids).pow(2).sum().backward()
    torch.testing.assert_close(got_w.grad, want_w.grad)


@pytest.mark.parametrize("executor", ["python", "cpp"])
def test_a_dispatch_mode_sees_the_aten_op(executor):
    w, ids = weights(32, 8, torch.float32), ids_for(32, (4,), torch.int64, 13)
    cg = compiled(lookup, (w, ids), executor)
    with LoggingDispatchMode() as mode:
        got = cg(w, ids)
    assert "aten.embedding.default" in mode.seen
    torch.testing.assert_close(got, lookup(w, ids), rtol=0, atol=0)


def test_out_overload_checks_its_output():
    w, ids = weights(32, 8, torch.float32), ids_for(32, (4,), torch.int64, 14)
    out = torch.empty(4, 8)
    torch.ops.fxrt.embedding.out(w, ids, out=out)
    torch.testing.assert_close(out, lookup(w, ids), rtol=0, atol=0)
    # Another dtype or layout of out is filled through eager's result; another size is named.
    out64 = torch.empty(4, 8, dtype=torch.float64)
    torch.ops.fxrt.embedding.out(w, ids, out=out64)
    torch.testing.assert_close(out64, lookup(w, ids).double(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="out has sizes"):
        torch.ops.fxrt.embedding.out(w, ids, out=torch.empty(3, 8))


def test_the_fast_path_runs_here():
    # Off the fast path fxrt::embedding calls aten::embedding, which index_selects: a profile of
    # the fast path shows neither.
    w = weights(128, 64, torch.float32)
    ids = ids_for(128, (1, 16), torch.int64, 15)
    for executor in ("python", "cpp"):
        cg = compiled(lookup_scaled, (w, ids), executor)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = cg(w, ids)
        names = {e.name for e in prof.events()}
        assert "aten::index_select" not in names and "aten::embedding" not in names, names
        torch.testing.assert_close(got, lookup_scaled(w, ids), rtol=0, atol=0)
