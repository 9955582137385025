"""The arena's peak rule (fxrt.exec.arena, ``CompilerConfig.arena_headroom``): the arena is held
for all of a call, so where its widest moment and the widest moment outside it fall at different
nodes, it raises a call's peak above the lifetime plan's; results leave it until the peak is
within the headroom (or a page). Peaks are measured (the allocator's events under the profiler,
plus the arena), not taken from the plan."""

from __future__ import annotations

import math

import pytest
import torch
from test_arena import compile_fn, loops, slotted
from torch.profiler import ProfilerActivity, profile

from fxrt.exec.arena import PAGE
from fxrt.exec.arena_verify import verify_arena


def peaks_apart(x, w):
    # Early: sin, cos and exp of x live together (slots); late: w @ w and a concatenation (slots),
    # then the concatenation and the output (never a slot), twice as wide, when the early ones
    # are gone.
    a, b, d = x.sin(), x.cos(), x.exp()
    c = (a * b * d).sum()
    return torch.cat([w @ w, w], 1) * c


def inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)]


def measured_peak(loop, args) -> int:
    """The most bytes a call holds at once: its allocations, the arena it uses included (held
    between calls, so added whole)."""
    loop(args)  # the arena is made on the first call
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loop(args)
    live = peak = 0
    events = prof.profiler.kineto_results.events()
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += n
        peak = max(peak, live)
    arena = loop.program.arena
    return peak + (arena.nbytes if arena is not None else 0)


def test_slots_leave_the_arena_until_the_peak_is_within_the_headroom():
    unbounded = compile_fn(peaks_apart, *inputs(0), arena_headroom=math.inf)
    bounded = compile_fn(peaks_apart, *inputs(0))  # the default: 1/8
    tight = compile_fn(peaks_apart, *inputs(0), arena_headroom=0.0)
    plan_peak = bounded.plan.peak_bytes
    assert unbounded.plan.peak_bytes == plan_peak
    assert {"sin", "cos", "exp", "mm", "cat"} <= slotted(unbounded)
    assert "cat" in slotted(bounded) and not {"sin", "cos", "exp"} <= slotted(bounded)
    for cg, headroom in ((bounded, 0.125), (tight, 0.0)):
        verify_arena(cg.graph, cg.plan, cg.program.arena)
        limit = plan_peak + max(plan_peak * headroom, PAGE)  # less than a page is let be
        for loop in loops(cg.program):
            assert measured_peak(loop, inputs(1)) <= limit, type(loop).__name__
    # the rule has work to do here: with every slot kept, the arena raises the peak past it
    for loop in loops(unbounded.program):
        assert measured_peak(loop, inputs(1)) > plan_peak * 1.125
    for cg in (unbounded, bounded, tight):
        for loop in loops(cg.program):
            for seed in (2, 3):
                args = inputs(seed)
                torch.testing.assert_close(loop(args), peaks_apart(*args))


def test_a_graph_whose_peaks_coincide_keeps_every_slot():
    def chain(x):
        return (x.sin() * x.cos()).exp()

    x = torch.randn(64, 64)
    assert slotted(compile_fn(chain, x, arena_headroom=0.0)) == slotted(
        compile_fn(chain, x, arena_headroom=math.inf)
    )


@pytest.mark.parametrize("bad", [-0.5, math.nan, "1/8", True, None])
def test_a_bad_headroom_is_named(bad):
    with pytest.raises(ValueError, match="arena_headroom must be a number >= 0"):
        compile_fn(peaks_apart, *inputs(0), arena_headroom=bad)


def test_the_headroom_from_the_environment(monkeypatch):
    import fxrt

    monkeypatch.setenv("FXRT_ARENA_HEADROOM", "0")
    assert fxrt.CompilerConfig().arena_headroom == 0.0
    monkeypatch.setenv("FXRT_ARENA_HEADROOM", "lots")
    with pytest.raises(ValueError, match="FXRT_ARENA_HEADROOM='lots': expected a number"):
        fxrt.CompilerConfig()


_CHILD = """
import json, math, sys
import torch
sys.path.insert(0, {tests!r})
import fxrt
from torch.fx.experimental.proxy_tensor import make_fx
from test_arena_peak import inputs, peaks_apart, slotted
out = {{}}
for name, headroom in (("bounded", 0.125), ("unbounded", math.inf)):
    gm = make_fx(peaks_apart)(*inputs(0))
    cg = fxrt.compile_graph(gm, inputs(0), fxrt.CompilerConfig(arena_headroom=headroom))
    args = inputs(5)
    torch.testing.assert_close(cg(*args), peaks_apart(*args))
    out[name] = sorted(slotted(cg))
out["stats"] = dict(fxrt.cache.stats)
print(json.dumps(out))
"""


def test_a_warm_process_places_the_arena_as_a_cold_one(tmp_path):
    # The headroom is part of the cache key: each setting has its entry, and a hit in a second
    # process gives the arena the miss gave.
    import json
    import os
    import subprocess
    import sys

    script = _CHILD.format(tests=os.path.dirname(__file__))
    runs = []
    for _ in ("cold", "warm"):
        env = {**os.environ, "FXRT_CACHE_DIR": str(tmp_path / "cache")}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    cold_stats, warm_stats = cold.pop("stats"), warm.pop("stats")
    assert cold == warm and cold["bounded"] != cold["unbounded"], runs
    assert cold_stats.get("stored", 0) == 2 and warm_stats.get("hit", 0) == 2, runs
