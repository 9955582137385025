"""What the torch.compile entry adds around fxrt's loop, per call, on W1-W3.

For each workload, the CompiledGraph fxrt builds under ``torch.compile(backend="fxrt")`` is
captured together with the flat inputs Dynamo passes it, and these are timed side by side,
interleaved (medians, µs per call):

  loop          the compiled loop called directly with those inputs: what torch.compile calls
                (``CompiledGraph.entry``; no Python frame of fxrt's)
  CompiledGraph fxrt's Python wrapper around it (boxed/flat dispatch, profiler and capture
                checks), which torch.compile reaches only while a profiler is on or with capture
  torch.compile the whole entry: Dynamo's frame evaluation and guards, then the loop
  via AOT       the same graph compiled through AOTAutograd (the training path), whose runtime
                wrappers fxrt's inference path leaves out
  eager         the model itself

Then the per-call costs of the compiled loop called as torch.compile calls it
(``CompiledGraph.entry``): an empty graph and a one-op graph (``x + 1`` on 4 floats), and the cost
of each static input (a parameter the graph takes as an input), kept between calls (the inputs
``torch.compile`` marks static: parameters, buffers) and not. Last, ``fxrt.load`` against the
package's own compiled graph called directly (its weights and inputs in one list made once), on
two tiny packages where any per-call work shows: a Linear + ReLU (tensor inputs only) and
``x + ones(n)`` with an int input ``n`` (the size symbol of ``x``'s dimension).

Usage: python benchmarks/entry.py [--rounds N]
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import fxrt
from fxrt.bench import measure
from fxrt.models import workloads


def capture(model: torch.nn.Module, inputs: tuple) -> tuple[fxrt.CompiledGraph, list]:
    """The CompiledGraph fxrt builds for ``model`` and the flat inputs Dynamo calls it with."""
    captured: dict = {}

    def capturing_backend(gm, example_inputs, **kw):
        entry = fxrt.backend(gm, example_inputs, **kw)
        captured["cg"] = getattr(entry, "_owner", None) or entry  # the loop's graph

        def first_call(*flat):
            captured.setdefault("inputs", list(flat))
            return entry(*flat)

        return first_call

    torch._dynamo.reset()
    torch.compile(model, backend=capturing_backend)(*inputs)
    return captured["cg"], captured["inputs"]


def contenders(model: torch.nn.Module, inputs: tuple) -> tuple[dict, str]:
    cg, flat = capture(model, inputs)
    aot = aot_autograd(fw_compiler=fxrt.get_compiler(), keep_inference_input_mutations=True)
    torch._dynamo.reset()
    fns = {
        "eager": model,
        "torch.compile": torch.compile(model, backend="fxrt"),
        "via AOT": torch.compile(model, backend=aot),
        # Dynamo graphs return a tuple; unwrap so every contender returns what the model does.
        "CompiledGraph": lambda *_: cg(*flat)[0],
        "loop": lambda *_: cg._loop(flat)[0],  # what torch.compile calls
    }
    return fns, cg.executor


def fixed_costs(rounds: int) -> str:
    """ns per call of an empty and a one-op graph, and per static input (kept and not)."""
    import timeit

    from torch.fx.experimental.proxy_tensor import make_fx

    def ns(f: object, n: int = 20000) -> float:
        return min(timeit.repeat(f, number=n, repeat=rounds)) / n * 1e9

    x = torch.randn(4)
    one = fxrt.compile_graph(make_fx(lambda x: x + 1)(x), [x]).entry()
    empty = fxrt.compile_graph(make_fx(lambda x: x)(x), [x]).entry()
    lines = [
        f"empty graph: {ns(lambda: empty([x])):.0f} ns per call; one op: "
        f"{ns(lambda: one([x])):.0f} ns (eager x + 1: {ns(lambda: x + 1):.0f} ns)"
    ]
    for k in (16, 256):
        ins = [x] + [nn.Parameter(torch.randn(4), requires_grad=False) for _ in range(k)]
        gm = make_fx(lambda *a: a[0] + 1)(*ins)
        plain = fxrt.compile_graph(gm, ins).entry()
        kept = fxrt.compile_graph(gm, ins).entry(list(range(1, k + 1)))
        base = ns(lambda: one([x]))
        lines.append(
            f"{k} static inputs: {(ns(lambda f=kept, a=ins: f(a)) - base) / k:.1f} ns each kept, "
            f"{(ns(lambda f=plain, a=ins: f(a)) - base) / k:.1f} ns not kept"
        )
    return "\n".join(lines)


class _Ones(nn.Module):
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x + torch.ones(n)


def package_costs(rounds: int) -> str:
    """ns per call of fxrt.load's model vs its compiled graph called directly, tiny packages."""
    import tempfile
    import timeit
    from pathlib import Path

    from torch.export import Dim

    def ns(f: object, n: int = 20000) -> float:
        return min(timeit.repeat(f, number=n, repeat=rounds)) / n * 1e9

    torch.manual_seed(0)
    lines = []
    tmp = Path(tempfile.mkdtemp(prefix="fxrt-entry-bench-"))
    cases = [
        ("Linear + ReLU", nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(), (torch.randn(2, 8),),
         None),
        ("x + ones(n), an int input", _Ones(), (torch.randn(3), 3),
         ({0: Dim.DYNAMIC}, Dim.DYNAMIC)),
    ]  # fmt: skip
    for name, model, args, dyn in cases:
        fxrt.export(model, args, dynamic_shapes=dyn).save(tmp / "p.fxrt")
        loaded = fxrt.load(tmp / "p.fxrt")
        graph, flat = loaded._run, [*loaded._state[0], *args]
        torch.testing.assert_close(loaded(*args), model(*args))
        a = ns(lambda m=loaded, a=args: m(*a))
        b = ns(lambda g=graph, f=flat: g(f)[0])
        lines.append(f"{name}: fxrt.load {a:.0f} ns, its graph directly {b:.0f} ns ({a / b:.2f}x)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = {}
    for wname, (model, inputs) in workloads().items():
        with torch.inference_mode():
            fns, executor = contenders(model, inputs)
            expected = model(*inputs)
            for fn in fns.values():
                torch.testing.assert_close(fn(*inputs), expected, rtol=1e-4, atol=1e-4)
            rows[wname] = measure(fns, inputs, args.rounds)
        print(f"{wname}: done ({executor} loop)", file=sys.stderr)
    names = list(next(iter(rows.values())))
    print("| workload | " + " | ".join(names) + " | Dynamo+guards | wrapper (unused) |")
    print("|---|" + "---|" * (len(names) + 2))
    for wname, r in rows.items():
        cells = " | ".join(f"{r[n]:.1f}" for n in names)
        dynamo = r["torch.compile"] - r["loop"]
        wrapper = r["CompiledGraph"] - r["loop"]
        print(f"| {wname} | {cells} | {dynamo:.1f} | {wrapper:.1f} |")
    print(
        "\nµs per call, medians; the last two columns are differences of the medians: "
        "torch.compile - loop, and CompiledGraph - loop (the frame torch.compile no longer calls)."
    )
    with torch.inference_mode():
        print("\nPer call, the compiled loop as torch.compile calls it:\n" + fixed_costs(9))
        print("\nPer call, fxrt.load vs the package's graph directly:\n" + package_costs(9))
    return 0


if __name__ == "__main__":
    sys.exit(main())
