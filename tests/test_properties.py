"""Property-based tests: random ATen graphs through the IR, the planner and both loops.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (the default under ``make test``: 2,000+ graphs in all),
``thorough`` (many more: ``HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest
tests/test_properties.py``), ``dev`` (a quick look).
"""

from __future__ import annotations

from typing import Any

import torch
from conftest import native_available
from graphgen import GeneratedGraph, generated_graphs
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st

import fxrt
from fxrt.exec.memory import measure_live_bytes
from fxrt.exec.plan import bind_sizes, plan_lifetimes
from fxrt.exec.program import Free
from fxrt.ir import from_fx, graph_to_text, refs_in, verify
from fxrt.passes import LEVELS, PASSES
from fxrt.serialize import dump_graph, load_graph

LOOPS = ["python", "cpp"] if native_available() else ["python"]


def compile_loop(g: GeneratedGraph, loop: str) -> fxrt.CompiledGraph:
    config = fxrt.CompilerConfig(pure_python=loop == "python", cache=False)
    cg = fxrt.compile_graph(g.gm, None, config)
    assert cg.executor == loop
    return cg


def storage_of(x: Any) -> int | None:
    if isinstance(x, torch.Tensor) and x.untyped_storage().nbytes():
        return x.untyped_storage().data_ptr()
    return None


def alias_signature(outputs: tuple, inputs: list) -> list:
    """Which inputs each output shares storage with, and which earlier outputs."""
    in_st = [storage_of(x) for x in inputs]
    out_st = [storage_of(o) for o in outputs]
    return [
        (
            [j for j, s in enumerate(in_st) if s is not None and s == st],
            [j for j, s in enumerate(out_st[:i]) if s is not None and s == st],
        )
        for i, st in enumerate(out_st)
    ]


def assert_same(got: tuple, want: tuple) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for a, b in zip(got, want, strict=True):
        if isinstance(b, torch.Tensor):
            assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        else:
            assert a == b


@given(generated_graphs())
def test_verifier_accepts_and_text_and_artifact_round_trip(g: GeneratedGraph):
    note(repr(g))
    graph = verify(from_fx(g.gm))
    text = graph_to_text(graph)
    assert text == graph_to_text(verify(from_fx(g.gm)))
    plan = plan_lifetimes(graph)
    loaded, loaded_plan, _ = load_graph(dump_graph(graph))  # the plan is recomputed on load
    assert graph_to_text(verify(loaded)) == text and loaded_plan == plan


# What make_fx raises when it cannot trace a generated graph symbolically: a guard on a
# data-dependent size, an op without a symbolic-shape rule (RuntimeError, NotImplementedError),
# a real tensor constant in the graph, which symbolic tracing refuses ("Please convert all
# Tensors to FakeTensors": AssertionError). The try covers the trace only, never fxrt.
SYMBOLIC_TRACE_ERRORS = (RuntimeError, NotImplementedError, AssertionError)


@settings(max_examples=max(50, settings().max_examples // 6))
@given(generated_graphs())
def test_symbolic_trace_runs_on_both_loops(g: GeneratedGraph):
    """The same graphs traced with symbolic sizes (sym_size nodes, SymInt arithmetic, int lists
    mixing registers and constants) agree with eager on both loops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    note(repr(g))
    inputs = g.inputs()
    try:
        sym = make_fx(g.gm, tracing_mode="symbolic")(*inputs)
    except SYMBOLIC_TRACE_ERRORS as e:  # a guard on a size make_fx cannot express symbolically
        note(f"no symbolic trace: {type(e).__name__}: {e}")
        assume(False)
    want = g.gm(*g.inputs())
    for loop in LOOPS:
        cfg = fxrt.CompilerConfig(pure_python=loop == "python", cache=False)
        cg = fxrt.compile_graph(sym, None, cfg)
        got = cg(*g.inputs())
        assert len(got) == len(want), (len(got), len(want))
        for a, b in zip(got, want, strict=True):
            if isinstance(b, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            else:
                assert a == b


@given(generated_graphs())
def test_plan_frees_exactly_once_and_never_early(g: GeneratedGraph):
    note(repr(g))
    cg = compile_loop(g, "python")
    plan, program, graph = cg.plan, cg.program, cg.graph
    never = set(graph.inputs) | set(graph.constants) | set(refs_in(graph.output))
    freed_at: dict[int, int] = {}
    for pc, ins in enumerate(program.code):
        reads = refs_in((ins.args, ins.kwargs)) if not isinstance(ins, Free) else []
        # nothing read here was freed before, nor shares an alias set with a freed value
        freed_roots = {plan.alias_root[v] for v in freed_at}
        assert not [v for v in reads if v in freed_at or plan.alias_root[v] in freed_roots], pc
        if isinstance(ins, Free):
            for v in ins.regs:
                assert v not in never, f"FREE of input/output/constant %{v}"
                assert v not in freed_at, f"%{v} freed twice"
                freed_at[v] = pc
    defined = {v for node in graph.nodes for v in node.outputs}
    should_free = {v for v in defined if v not in plan.pinned}
    assert set(freed_at) == should_free
    assert not (plan.pinned - never) or all(
        plan.alias_root[v] in {plan.alias_root[p] for p in never} for v in plan.pinned
    )


@given(generated_graphs())
def test_predicted_peak_matches_replay_and_beats_no_free(g: GeneratedGraph):
    note(repr(g))
    cg = compile_loop(g, "python")
    no_free_peak = sum(
        graph_value.meta.storage_nbytes or 0
        for graph_value in cg.graph.values
        if graph_value.id in cg.plan.roots and graph_value.meta is not None
    )
    assert cg.plan.peak_bytes <= no_free_peak
    if cg.plan.exact:
        want_bytes = cg.plan.live_bytes_for(bind_sizes(cg.graph, g.inputs()))
        assert measure_live_bytes(cg.program, g.inputs()) == want_bytes


@given(generated_graphs())
def test_loops_agree_with_eager(g: GeneratedGraph):
    note(repr(g))
    eager_inputs = g.inputs()
    want = g.gm(*eager_inputs)
    want_alias = alias_signature(want, eager_inputs)
    for loop in LOOPS:
        cg = compile_loop(g, loop)
        inputs = g.inputs()
        got = cg(*inputs)
        assert_same(got, want)
        assert alias_signature(got, inputs) == want_alias, loop
        assert_same(tuple(inputs), tuple(eager_inputs))  # in-place effects on inputs match
        if loop == "python":
            check_runtime_aliasing(cg, g.inputs())


def check_runtime_aliasing(cg: fxrt.CompiledGraph, inputs: list) -> None:
    """Live values that share a storage at run time must be in one alias set of the plan, but
    for an arena slot handed over in place (fxrt.exec.inplace): right after the node that writes
    over it, the old value (freed next) and the new one share their bytes."""
    arena = cg.program.arena
    root = cg.plan.alias_root
    handed = {
        (s.first, frozenset({root[s.takes_over], root[s.value]}))
        for s in (arena.slots if arena is not None else ())
        if s.takes_over >= 0
    }

    def after_node(node: int, regs: list, _t0: int, _t1: int) -> None:
        roots_of: dict[int, set[int]] = {}
        for v, x in enumerate(regs):
            st = storage_of(x)
            if st is not None:
                roots_of.setdefault(st, set()).add(root[v])
        for roots in roots_of.values():
            if (node, frozenset(roots)) in handed:
                continue
            assert len(roots) == 1, f"after node {node}: one storage in alias sets {roots}"

    cg._loop.run_observed(inputs, after_node)


PASS_CHOICES = [[name] for name in PASSES] + [list(LEVELS[2])]


@given(generated_graphs(), st.sampled_from(PASS_CHOICES))
def test_passes_leave_results_unchanged(g: GeneratedGraph, passes: list[str]):
    note(repr(g))
    eager_inputs = g.inputs()
    want = g.gm(*eager_inputs)
    want_alias = alias_signature(want, eager_inputs)
    config = fxrt.CompilerConfig(pure_python=True, passes=passes, cache=False)
    cg = fxrt.compile_graph(g.gm, None, config)
    note(str(cg.program))
    inputs = g.inputs()
    got = cg(*inputs)
    assert_same(got, want)
    assert alias_signature(got, inputs) == want_alias
    assert_same(tuple(inputs), tuple(eager_inputs))
    if cg.plan.exact:
        want_bytes = cg.plan.live_bytes_for(bind_sizes(cg.graph, g.inputs()))
        assert measure_live_bytes(cg.program, g.inputs()) == want_bytes
