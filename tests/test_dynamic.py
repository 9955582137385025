"""Dynamic shapes: one compiled graph serves many sizes, on both loops."""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from conftest import recording_compiles, skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.exec.memory import measure_live_bytes
from fxrt.exec.plan import bind_sizes
from fxrt.models import KVCacheDecoder


def count_dynamo_graphs(fn, calls, backend, **kw):
    """Run ``calls`` through ``torch.compile(fn, backend=...)``; return outputs and graph count."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, backend=backend, dynamic=True, **kw)
    outs = [compiled(*args) for args in calls]
    return outs, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def decoder_calls(max_len=64):
    """Every sequence length 1..64, cycling through batch sizes 1..4."""
    torch.manual_seed(0)
    calls = []
    for seq in range(1, max_len + 1):
        batch = 1 + seq % 4
        k, v = KVCacheDecoder().empty_cache(batch, max_len)
        calls.append((torch.randn(batch, seq, 32), k, v, torch.arange(seq)))
    return calls


@functools.cache
def dynamo_graph_count() -> int:
    """How many graphs Dynamo itself compiles for the decoder calls (aot_eager)."""
    with torch.no_grad():
        return count_dynamo_graphs(KVCacheDecoder().eval(), decoder_calls(), "aot_eager")[1]


def test_kv_cache_decoder_all_sizes_one_compile(executor):
    skip_unless_executor(executor)
    model = KVCacheDecoder().eval()
    calls = decoder_calls()
    opts = {"pure_python": executor == "python"}
    with torch.no_grad():
        eager_calls = copy.deepcopy(calls)
        want = [model(*args) for args in eager_calls]
        dynamo_graphs = dynamo_graph_count()
        with recording_compiles() as built:
            got, fxrt_graphs = count_dynamo_graphs(model, calls, "fxrt", options=opts)
    for g, w, (_, k, v, _), (_, ek, ev, _) in zip(got, want, calls, eager_calls):
        torch.testing.assert_close(g, w)
        torch.testing.assert_close((k, v), (ek, ev))  # the in-place cache writes match
    assert fxrt_graphs == dynamo_graphs  # no recompiles beyond Dynamo's own
    assert len(built) == fxrt_graphs
    assert dynamo_graphs <= 4, dynamo_graphs  # 64 calls: Dynamo specializes size 1, no more
    assert {cg.executor for cg in built} == {executor}


def test_attention_with_symbolic_mask(executor):
    skip_unless_executor(executor)

    def attn(q, k, v):
        s = q.shape[-2]
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v, F.softmax(
            scores, -1
        ).amax(-1)

    calls = [tuple(torch.randn(2, n, 8) for _ in range(3)) for n in (3, 5, 9, 17)]
    with torch.no_grad(), recording_compiles() as built:
        got, n = count_dynamo_graphs(
            attn, calls, "fxrt", options={"pure_python": executor == "python"}
        )
    for g, args in zip(got, calls):
        torch.testing.assert_close(g, attn(*args))
    assert n == 1 and len(built) == 1


def test_output_shape_depends_on_symbolic_size(executor):
    skip_unless_executor(executor)

    def f(x):
        n, m = x.shape
        y = x.new_zeros(n * 2, m + 1)
        y[:n, :m] = x
        return y.reshape(-1), torch.arange(n * m).view(n, m) * x

    calls = [(torch.randn(n, m),) for n, m in ((2, 3), (4, 5), (7, 2), (3, 3))]
    with torch.no_grad(), recording_compiles() as built:
        got, n = count_dynamic = count_dynamo_graphs(
            f, calls, "fxrt", options={"pure_python": executor == "python"}
        )
    del count_dynamic
    for g, args in zip(got, calls):
        torch.testing.assert_close(g, f(*args))
        assert g[0].shape == (args[0].shape[0] * 2 * (args[0].shape[1] + 1),)
    assert n == 1 and len(built) == 1
    assert built[0].program.fallbacks or built[0].plan.symbolic


def test_planner_bytes_are_expressions_evaluated_per_call():
    def f(x, y):
        return (x @ y).relu().sum(0) + 1

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(3, 4), torch.randn(4, 5))
    cg = fxrt.compile_graph(gm, None, fxrt.CompilerConfig(cache=False, pure_python=True))
    assert cg.plan.symbolic and all(isinstance(b, str) for b in cg.plan.live_bytes)
    for n, k, m in ((7, 2, 9), (1, 5, 3), (16, 16, 16)):
        x, y = torch.randn(n, k), torch.randn(k, m)
        bindings = bind_sizes(cg.graph, [x, y])
        assert measure_live_bytes(cg.program, [x, y]) == cg.plan.live_bytes_for(bindings)
        torch.testing.assert_close(cg(x, y), f(x, y))
