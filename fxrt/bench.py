"""``python -m fxrt bench``: host overhead of W1-W3 under eager, aot_eager, inductor, fxrt and the
direct executors (``benchmarks/overhead.py`` runs the same).

Every competitor runs the same model on the same inputs in one process. Timing is interleaved:
each round times a batch of calls of every competitor, in a shuffled order, and the reported figure
is the median over rounds of the mean call time in the batch (microseconds per call). Ratios are
against eager and aot_eager. The machines this runs on are shared and noisy, so read ratios, not
absolute times.

Competitors:
  eager            the nn.Module called as it is
  aot_eager        torch.compile(backend="aot_eager")
  inductor         torch.compile(backend="inductor")
  fxrt             torch.compile(backend="fxrt") (default loop: compiled when built)
  fxrt[py]         torch.compile(backend="fxrt", options={"pure_python": True})
  loop[cpp]        the compiled loop called directly on the graph make_fx traces (no Dynamo)
  loop[py]         the Python loop called directly on that graph
  static_runtime   PyTorch Static Runtime on the frozen traced module

Usage: python -m fxrt bench [--rounds N] [--only W1,W2] [--json out.json] [--md out.md]

The table is printed and also written, with the raw figures, to ``bench-results/bench.md`` and
``bench-results/bench.json`` under the current directory (``--md``/``--json`` change the paths; an
empty path writes nothing). The benchmark runs torch with one intra-op thread
(``torch.set_num_threads(1)``): on a small shared machine two threads made every backend 30-100x
slower.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from . import __version__
from .compiler import compile_graph
from .config import CompilerConfig
from .models import workloads


def _compiled(model: torch.nn.Module, backend: str, **kw: Any) -> Callable:
    return torch.compile(model, backend=backend, **kw)


def _direct(
    model: torch.nn.Module, inputs: tuple, pure_python: bool, **options: Any
) -> Callable | None:
    gm = make_fx(model)(*inputs)  # parameters become constants of the graph
    # Frozen, as Static Runtime's module is (torch.jit.freeze): weights may be folded.
    config = CompilerConfig(pure_python=pure_python, freeze=True, **options)
    cg = compile_graph(gm, inputs, config)
    if cg.executor != ("python" if pure_python else "cpp"):
        return None
    return cg


def _static_runtime(model: torch.nn.Module, inputs: tuple) -> Callable:
    traced = torch.jit.freeze(torch.jit.trace(model, inputs).eval())
    return torch._C._jit_to_static_module(traced._c)


def competitors(model: torch.nn.Module, inputs: tuple) -> dict[str, Callable | None]:
    return {
        "eager": model,
        "aot_eager": _compiled(model, "aot_eager"),
        "inductor": _compiled(model, "inductor"),
        "fxrt": _compiled(model, "fxrt"),
        "fxrt[py]": _compiled(model, "fxrt", options={"pure_python": True}),
        "fxrt[aten]": _compiled(model, "fxrt", options={"own_ops": False}),
        "loop[cpp]": _direct(model, inputs, pure_python=False),
        "loop[cpp] unchecked": _direct(model, inputs, pure_python=False, check_inputs=False),
        "loop[py]": _direct(model, inputs, pure_python=True),
        "static_runtime": _static_runtime(model, inputs),
    }


def measure(
    fns: dict[str, Callable],
    inputs: tuple,
    rounds: int,
    target_s: float = 0.02,
    clock: Callable[[], float] = time.perf_counter,
    batches: dict[str, Callable[[int], float]] | None = None,
) -> dict[str, float]:
    """Median over ``rounds`` interleaved rounds of the mean µs per call, timed with ``clock``
    (wall time by default; ``time.thread_time`` gives the calling thread's CPU time).

    ``batches`` are competitors that time themselves (another process: the C++ runner):
    ``batch(n)`` makes n calls and returns the mean µs per call, on the same kind of clock. They
    take part in the same shuffled rounds."""
    batches = batches or {}
    calls: dict[str, int] = {}
    for name, fn in fns.items():  # warm up and size each batch to about target_s
        for _ in range(3):
            fn(*inputs)
        t0 = time.perf_counter()
        fn(*inputs)
        one = max(time.perf_counter() - t0, 1e-7)
        calls[name] = max(5, min(2000, int(target_s / one)))
    for name, batch in batches.items():
        batch(3)
        one = max(batch(1) * 1e-6, 1e-7)
        calls[name] = max(5, min(2000, int(target_s / one)))
    samples: dict[str, list[float]] = {name: [] for name in [*fns, *batches]}
    order = list(samples)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            n = calls[name]
            if name in batches:
                samples[name].append(batches[name](n))
                continue
            fn = fns[name]
            t0 = clock()
            for _ in range(n):
                fn(*inputs)
            samples[name].append((clock() - t0) / n * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def input_check_cost(rounds: int, clock: Callable[[], float], n: int = 64) -> float:
    """µs per tensor input that the compiled loop's input check costs: a graph of ``n`` inputs
    whose only op reads the first, its loop called with checks on and off, interleaved (a
    difference per call of n times a few tens of ns, which W1-W3's single input would hide in
    their noise)."""
    inputs = tuple(torch.randn(4, 4) for _ in range(n))
    gm = make_fx(lambda *xs: xs[0].neg())(*inputs)
    fns = {
        check: compile_graph(gm, inputs, CompilerConfig(check_inputs=check, cache=False))
        for check in (True, False)
    }
    if any(cg.executor != "cpp" for cg in fns.values()):
        return float("nan")
    loops = {str(k): (lambda *xs, loop=cg._loop: loop(xs)) for k, cg in fns.items()}
    t = measure(loops, inputs, max(rounds, 25), target_s=0.05, clock=clock)
    return (t["True"] - t["False"]) / n


def check_outputs(fns: dict[str, Callable], inputs: tuple) -> None:
    expected = fns["eager"](*inputs)
    for name, fn in fns.items():
        torch.testing.assert_close(
            fn(*inputs), expected, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fxrt bench",
        description="W1-W3 host overhead. Prints a markdown table and writes it, with the raw "
        "figures, to ./bench-results/ (see --md and --json).",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=15,
        help="interleaved timing rounds per workload; each figure is the median over rounds "
        "(default: %(default)s; the README's figures use 25)",
    )
    p.add_argument("--only", default="", help="comma-separated workload prefixes, e.g. W1,W3")
    p.add_argument(
        "--json",
        default="bench-results/bench.json",
        help="JSON results file (default: %(default)s; '' for none)",
    )
    p.add_argument(
        "--md",
        default="bench-results/bench.md",
        help="markdown table file (default: %(default)s; '' for none)",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: time with the thread's CPU time, so time descheduled on a busy machine does "
        "not count (every competitor runs its ops on the calling thread)",
    )
    args = p.parse_args(argv)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)

    results: dict[str, dict[str, float]] = {}
    chosen = [
        (w, m)
        for w, m in workloads().items()
        if not args.only or any(w.startswith(o) for o in args.only.split(","))
    ]
    for i, (wname, (model, inputs)) in enumerate(chosen):
        progress(i, len(chosen), f"{wname}: compiling")
        torch._dynamo.reset()
        with torch.inference_mode():
            fns = {k: v for k, v in competitors(model, inputs).items() if v is not None}
            check_outputs(fns, inputs)
            progress(i, len(chosen), f"{wname}: timing {len(fns)} competitors")
            results[wname] = measure(fns, inputs, args.rounds, clock=clock)
    progress(len(chosen), len(chosen), "done")
    print(file=sys.stderr)

    table = markdown(results)
    with torch.inference_mode():
        per_input = input_check_cost(args.rounds, clock)
    table += f"\nThe compiled loop's input check: {per_input:.3f} µs per tensor input.\n"
    print(table)
    for path in (args.md, args.json):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"torch": torch.__version__, "fxrt": __version__, "us_per_call": results},
                f,
                indent=2,
            )
    written = [os.path.abspath(path) for path in (args.md, args.json) if path]
    if written:
        print(f"written: {', '.join(written)}", file=sys.stderr)
    return 0


def progress(done: int, total: int, what: str, width: int = 30) -> None:
    """A one-line progress bar on stderr."""
    filled = round(width * done / max(total, 1))
    bar = "#" * filled + "." * (width - filled)
    print(f"\r[{bar}] {done}/{total} {what:<40}", end="", file=sys.stderr, flush=True)


def markdown(results: dict[str, dict[str, float]]) -> str:
    names = list(dict.fromkeys(n for r in results.values() for n in r))
    head = "| workload | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 1)]
    for wname, r in results.items():
        cells = []
        for n in names:
            if n not in r:
                cells.append("n/a")
                continue
            cells.append(f"{r[n]:.1f} µs ({r[n] / r['eager']:.2f}x)")
        lines.append(f"| {wname} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Ratios in parentheses are against eager. fxrt vs aot_eager: "
        + ", ".join(
            f"{w.split()[0]} {r['fxrt'] / r['aot_eager']:.2f}x"
            for w, r in results.items()
            if "fxrt" in r
        )
        + ". loop[cpp] vs static_runtime: "
        + ", ".join(
            f"{w.split()[0]} {r['loop[cpp]'] / r['static_runtime']:.2f}x"
            for w, r in results.items()
            if "loop[cpp]" in r and "static_runtime" in r
        )
        + ". fxrt[aten] is fxrt without its own CPU ops (own_ops=False): fxrt vs "
        + "fxrt[aten] "
        + ", ".join(
            f"{w.split()[0]} {r['fxrt'] / r['fxrt[aten]']:.2f}x"
            for w, r in results.items()
            if "fxrt[aten]" in r
        )
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
