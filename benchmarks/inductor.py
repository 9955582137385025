"""Inductor alone vs Inductor + fxrt (``fxrt.register_fx_wrapper()``) on W1-W3 and a KV-cache
decoder step.

Both competitors are ``torch.compile(model)`` with Inductor's defaults, so they run the same
generated kernels; they differ only in the host code around them: Inductor's Python wrapper
(``call(args)`` in the generated module) against the FX host graph run by fxrt's compiled loop
(``inductor+fxrt``) or, with ``--python-loop``, its Python loop (``inductor+fxrt[py]``).

Timing is interleaved as in ``python -m fxrt bench`` (``fxrt.bench.measure``): each round times
a batch of calls of every competitor in a shuffled order; the figure is the median over rounds of
the mean call time (µs per call). ``--clock cpu`` times with the thread's CPU time instead of the
wall clock, so that time the process spends descheduled on a busy shared machine is not counted.
Two views per workload:

* ``full``: the ``torch.compile``d module called as users call it (Dynamo guards, AOTAutograd's
  runtime wrappers and Inductor's ``CompiledFxGraph`` included: the same code for both);
* ``host``: only the compiled module's ``call(args)`` (Inductor's Python wrapper vs fxrt's host
  graph), with the flat arguments AOTAutograd passes it.

Speedups are Inductor's time over the competitor's (above 1: faster than Inductor alone). The
machines this runs on are shared and noisy: read ratios, not absolute times.

Input checks, like for like: Inductor's Python wrapper starts with an ``assert_size_stride`` per
graph input (sizes, and strides of dimensions of size above 1; 17 on W2). The FX host graph drops
those lines, and fxrt's compiled loop checks the same inputs itself on every call
(``check_inputs``, on by default: dtype, device, rank, sizes, and strides of dimensions of size
above 1, in C++), a superset of the asserts. So ``inductor`` and ``inductor+fxrt`` both check their
inputs. ``inductor[no asserts]`` is Inductor compiled with ``size_asserts=False`` (no input checks)
and ``inductor+fxrt[unchecked]`` is fxrt with ``check_inputs=False``: the two figures without
checks, for comparison.

Usage: python benchmarks/inductor.py [--rounds N] [--only W2,W3] [--clock wall|cpu]
                                     [--python-loop] [--md out.md]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import fxrt
from fxrt.bench import measure
from fxrt.inductor import capturing_modules, compiled_host_graphs
from fxrt.models import DecoderBlock, workloads


def bench_workloads() -> dict[str, tuple[torch.nn.Module, tuple[Any, ...]]]:
    """W1-W3, and one decoder step writing its KV cache in place (``index_copy_`` on buffers,
    which Inductor's kernels do inside the host graph)."""
    out = dict(workloads())
    torch.manual_seed(0)
    out["decoder+kv"] = (
        DecoderBlock(128, 4, cache_len=64).eval(),
        (torch.randn(1, 1, 128), torch.tensor([5])),
    )
    return out


def measure_cpu(
    fns: dict[str, Callable], inputs: tuple, rounds: int, target_s: float = 0.02
) -> dict[str, float]:
    """``fxrt.bench.measure`` with the thread's CPU time as the clock (Inductor's kernels run on
    this thread: the benchmark sets one intra-op thread before compiling)."""
    return measure(fns, inputs, rounds, target_s, clock=time.thread_time)


def fresh_entry(model: torch.nn.Module, name: str) -> Callable[..., Any]:
    """``model(*args)`` behind a function with a code object of its own, named ``name``. Dynamo
    caches compiled code per code object, and with inlined nn.Modules its guards accept any
    instance of the same class, so two competitors compiling copies of one model would otherwise
    share one graph. The name must differ per workload too: Dynamo remembers the input sizes each
    function (by file name, line and name) was called with, and one called with new sizes is
    compiled again with dynamic shapes (``automatic_dynamic_shapes``)."""
    namespace = {"model": model}
    exec(compile("def entry(*args):\n    return model(*args)\n", f"<{name}>", "exec"), namespace)
    return namespace["entry"]


def flat_args(compiled: Callable, inputs: tuple) -> list[Any]:
    """The flat arguments AOTAutograd passes the compiled module when ``compiled`` (an
    Inductor + fxrt model) is called on ``inputs``, recorded where fxrt's graph receives them."""
    seen: list[list[Any]] = []
    original = fxrt.CompiledGraph.__call__

    def record(self: fxrt.CompiledGraph, *args: Any) -> Any:
        boxed = len(args) == 1 and type(args[0]) is list  # how Inductor calls it
        seen.append(list(args[0] if boxed else args))
        return original(self, *args)

    fxrt.CompiledGraph.__call__ = record
    try:
        compiled(*inputs)
    finally:
        fxrt.CompiledGraph.__call__ = original
    return seen[-1]


def _sharing_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with buffers of its own (a KV cache is written in place) and the
    original's parameters. Every competitor's GEMMs then read the same weight memory, so where
    the allocator placed a competitor's own copy of the weights cannot count as a difference
    between host codes."""
    return copy.deepcopy(model, memo={id(p): p for p in model.parameters()})


def compile_competitors(
    wname: str, model: torch.nn.Module, inputs: tuple, python_loop: bool
) -> dict[str, tuple[Callable, Callable]]:
    """name -> (full call, host-only call); each competitor compiles its own copy of the model
    (parameters shared, see :func:`_sharing_parameters`)."""
    variants: list[tuple[str, fxrt.CompilerConfig | None, bool]] = [  # (name, fxrt, asserts)
        ("inductor", None, True),
        ("inductor[no asserts]", None, False),
        ("inductor+fxrt", fxrt.CompilerConfig(pure_python=False), True),
        (
            "inductor+fxrt[unchecked]",
            fxrt.CompilerConfig(pure_python=False, check_inputs=False),
            True,
        ),
    ]
    if python_loop:
        variants.append(("inductor+fxrt[py]", fxrt.CompilerConfig(pure_python=True), True))
    compiled: dict[str, tuple[Callable, Any]] = {}
    for name, config, size_asserts in variants:
        entry = fresh_entry(_sharing_parameters(model), f"{wname}: {name}")
        if config is not None:
            fxrt.register_fx_wrapper(config)
        try:
            # Compile for real (no FX-graph or AOTAutograd cache hit) so the module is captured.
            with (
                capturing_modules() as mods,
                torch._inductor.config.patch(fx_graph_cache=False, size_asserts=size_asserts),
                torch._functorch.config.patch(enable_autograd_cache=False),
            ):
                fn = torch.compile(entry)
                fn(*inputs)
        finally:
            fxrt.unregister_fx_wrapper()
        if len(mods) != 1:
            raise RuntimeError(f"{name}: expected one compiled graph, got {len(mods)}")
        if config is not None and compiled_host_graphs()[-1].executor != (
            "python" if config.pure_python else "cpp"
        ):
            print(f"note: {name} runs fxrt's {compiled_host_graphs()[-1].executor} loop")
        compiled[name] = (fn, mods[0])
    # Every competitor compiled the same graph, so their modules take the same flat arguments.
    args = flat_args(compiled["inductor+fxrt"][0], inputs)
    out = {}
    for name, (fn, mod) in compiled.items():
        # Inductor's Python wrapper clears the list it is given (to free inputs early): a copy.
        out[name] = (fn, lambda call=mod.call: call(list(args)))
    return out


def check_outputs(model: torch.nn.Module, fns: dict[str, tuple[Callable, Callable]], inputs):
    """Every competitor matches eager, through both views (a KV-cache step rewrites the same
    positions each call, so repeated calls do not drift)."""
    expected = model(*inputs)
    for name, (full, host) in fns.items():
        host_out = host()
        for view, got in (("full", full(*inputs)), ("host", host_out)):
            got = got[0] if isinstance(got, (tuple, list)) else got  # Inductor's call -> tuple
            torch.testing.assert_close(
                got, expected, rtol=1e-4, atol=1e-4, msg=lambda m, n=name, v=view: f"{n} {v}: {m}"
            )


def _ignoring_inputs(fn: Callable[[], Any]) -> Callable[..., Any]:
    return lambda *_: fn()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--only", default="", help="comma-separated workload prefixes, e.g. W2,W3")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--python-loop", action="store_true", help="also time fxrt's Python loop")
    p.add_argument("--md", help="write the markdown table here")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # before compiling: Inductor bakes the thread count into kernels
    timer = measure if args.clock == "wall" else measure_cpu
    if not fxrt.runtime_info()["native_available"]:
        print("note: fxrt's compiled loop is not available; inductor+fxrt runs the Python loop")

    results: dict[str, dict[str, float]] = {}
    for wname, (model, inputs) in bench_workloads().items():
        if args.only and not any(wname.startswith(o) for o in args.only.split(",")):
            continue
        with torch.inference_mode():
            fns = compile_competitors(wname, model, inputs, args.python_loop)
            check_outputs(model, fns, inputs)
            timed = {f"{n} full": full for n, (full, _) in fns.items()}
            timed |= {f"{n} host": _ignoring_inputs(host) for n, (_, host) in fns.items()}
            results[wname] = timer(timed, inputs, args.rounds)
        print(f"{wname}: done", file=sys.stderr)

    table = markdown(results, args.clock)
    print(table)
    if args.md:
        Path(args.md).write_text(table + "\n")
    return 0


def markdown(results: dict[str, dict[str, float]], clock: str) -> str:
    names = list(dict.fromkeys(n.rsplit(" ", 1)[0] for r in results.values() for n in r))
    others = [n for n in names if n != "inductor"]
    head = ["workload", "view", "inductor"] + [f"{n} (speedup)" for n in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for wname, r in results.items():
        for view in ("full", "host"):
            base = r[f"inductor {view}"]
            cells = [wname, view, f"{base:.1f} µs"]
            for n in others:
                t = r[f"{n} {view}"]
                cells.append(f"{t:.1f} µs ({base / t:.2f}x)")
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"Median over interleaved rounds of the mean µs per call ({clock} clock); speedup = "
        "inductor / competitor (above 1: faster than Inductor alone). full: the torch.compile'd "
        "module; host: the compiled module's call(args) alone. inductor runs its "
        "assert_size_stride input checks and inductor+fxrt fxrt's own (a superset); "
        "[no asserts] and [unchecked] are the same without them."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
