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

Usage: python benchmarks/entry.py [--rounds N]
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
