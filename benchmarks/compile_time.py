"""Compile time against graph size: ``compile_graph`` on long elementwise chains.

Each size ``n`` is a ``make_fx`` trace of ``x = (x * 1.01).relu()`` repeated ``n / 2`` times on a
1x64 tensor: ``n`` ATen ops in one straight line, every intermediate a candidate for the arena.
That is the shape where a stage that compares every pair of nodes or slots shows up: its cost
grows with ``n**2`` while every other stage grows with ``n``. Tracing is not timed; the compile
runs with the verifier on (``CompilerConfig(verify=True)``) and the compile cache off, so every
run does the whole pipeline, in the default loop (C++ when built).

Reported per size, as a markdown table: the median over ``--repeats`` compiles of the total and of
each stage of the compile pipeline (``fxrt.pipeline``), in seconds: the stage's
``PassRecord.seconds`` in ``CompiledGraph.stage_records``, which include its check (the IR
verifier after a stage that changed the graph, ``verify_arena`` after ``plan_arena``).
``other`` is the total less all stages (the pipeline manager's snapshots and records, the
executor's construction). ``gc`` is the time the cyclic garbage collector ran during the compile,
inside whichever stages it interrupted (already counted in them): a full collection walks every
live object, the traced FX graph's included, so it adds lumps that grow with the heap, not with
fxrt's own work. One warm-up compile of a small chain runs first, so imports and per-op caches are
not counted. Wall-clock time: run it on a quiet machine.

Usage: python benchmarks/compile_time.py [--sizes 1000 3000 6000 15000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
import fxrt.passes

PASSES = fxrt.passes.LEVELS[2]  # the default built-in passes, in order
COLUMNS = (
    "total",
    "from_fx",
    "apply_kernel_overrides",
    *PASSES,
    "use_own_ops",
    "plan_lifetimes",
    "plan_arena",
    "lower",
    "other",
    "gc",
)

spent: dict[str, float] = defaultdict(float)  # stage -> seconds in the current compile


_gc_started = 0.0


def _gc_timer(phase: str, info: dict[str, Any]) -> None:
    global _gc_started
    if phase == "start":
        _gc_started = time.perf_counter()
    else:
        spent["gc"] += time.perf_counter() - _gc_started


def install_timers() -> None:
    gc.callbacks.append(_gc_timer)


def chain(n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(x: torch.Tensor) -> torch.Tensor:
        for _ in range(n // 2):
            x = (x * 1.01).relu()
        return x

    return f


def compile_once(gm: torch.fx.GraphModule, x: torch.Tensor) -> dict[str, float]:
    spent.clear()
    config = fxrt.CompilerConfig(cache=False, verify=True)
    t0 = time.perf_counter()
    cg = fxrt.compile_graph(gm, [x], config)
    total = time.perf_counter() - t0
    row = dict(spent)
    row.setdefault("gc", 0.0)
    for r in cg.stage_records:
        row[r.name] = row.get(r.name, 0.0) + r.seconds
    row["other"] = total - sum(v for k, v in row.items() if k != "gc")
    row["total"] = total
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 3000, 6000, 15000])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    install_timers()
    x = torch.randn(1, 64)
    compile_once(make_fx(chain(20))(x), x)  # warm-up
    print(
        f"torch {torch.__version__}, fxrt {fxrt.__version__}; seconds, median of "
        f"{args.repeats} compiles"
    )
    print()
    print("| ops | " + " | ".join(COLUMNS) + " |")
    print("|---:|" + "---:|" * len(COLUMNS))
    for n in args.sizes:
        gm = make_fx(chain(n))(x)
        rows = [compile_once(gm, x) for _ in range(args.repeats)]
        med = [statistics.median(r.get(c, 0.0) for r in rows) for c in COLUMNS]
        print(f"| {n} | " + " | ".join(f"{m:.3f}" for m in med) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
