"""Whole-graph capture: replay vs the op-by-op loop, per call, on a device with graphs.

Per workload, in one process, interleaved, medians of rounds (``fxrt.bench.measure``),
``torch.set_num_threads(1)``, under ``torch.inference_mode()``:

  loop      torch.compile(model, backend="fxrt"): the compiled loop issues every op
  replay    torch.compile(model, backend="fxrt", mode="reduce-overhead"): one replay per call
            (inputs copied in and outputs cloned, the defaults)
  own       the same replay's own host time: the compiled graph behind it called directly
            with the inputs Dynamo passes it (Dynamo's frame evaluation and guards left out)

each measured two ways: ``host``, the time until the call returns (what the host spends; the
device runs behind it), and ``done``, the call plus a device synchronize (time to completion).

Workloads: W2 (``MLP(256, 4)``, batch 1), W3 (``DecoderBlock(128, 4)``, 1 x 16 tokens) and a
decode step (``KVCacheDecoder(128, 4, 2 layers)``, one token at a time into caches of 64 positions
that are updated in place).

The device: ``--device standin`` (default) is the test suite's stand-in accelerator
(tests/standin: host memory, streams as worker threads; built on first use, about 30 s), whose
launch costs are the host's own dispatch; ``--device cuda`` runs the same on a GPU, with
Inductor's ``mode="reduce-overhead"`` (CUDA graphs) beside them, and reports capture time.

    python benchmarks/capture.py [--rounds 15] [--device standin|cuda] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fxrt  # noqa: E402
from fxrt.bench import measure  # noqa: E402
from fxrt.models import MLP, DecoderBlock, KVCacheDecoder  # noqa: E402


def workloads(device: str) -> dict[str, tuple[torch.nn.Module, tuple]]:
    torch.manual_seed(0)
    decoder = KVCacheDecoder(hidden=128, heads=4, layers=2).eval()
    k, v = decoder.empty_cache(1, 64)
    found = {
        "W2 mlp": (MLP(256, 4).eval(), (torch.randn(1, 256),)),
        "W3 decoder": (DecoderBlock(128, 4).eval(), (torch.randn(1, 16, 128),)),
        "decode step": (decoder, (torch.randn(1, 1, 128), k, v, torch.tensor([5]))),
    }
    return {
        name: (m.to(device), tuple(x.to(device) for x in xs)) for name, (m, xs) in found.items()
    }


def competitors(model: torch.nn.Module, device: str) -> tuple[dict[str, Callable], dict]:
    """The competitors, and ``seen``: the compiled graph behind the replay (``"cg"``) and the
    flat inputs Dynamo calls it with (``"inputs"``), filled on the first call."""
    torch._dynamo.reset()
    seen: dict[str, Any] = {}

    def keeping(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        cg = fxrt.backend(gm, example_inputs, **kwargs)
        seen["cg"] = cg

        def call(*flat: Any) -> Any:
            seen.setdefault("inputs", list(flat))
            return cg(*flat)

        return call

    fns = {
        "loop": torch.compile(copy.deepcopy(model), backend="fxrt", options={"cache": False}),
        "replay": torch.compile(copy.deepcopy(model), backend=keeping, mode="reduce-overhead"),
    }
    if device == "cuda":
        fns["inductor replay"] = torch.compile(copy.deepcopy(model), mode="reduce-overhead")
    return fns, seen


def own_replay(seen: dict, clock: Callable[[], float]) -> Callable[[int], float]:
    """A self-timed competitor: ``n`` calls of the compiled graph behind the replay, µs each."""
    cg, flat = seen["cg"], seen["inputs"]

    def batch(n: int) -> float:
        t0 = clock()
        for _ in range(n):
            cg(flat)
        return (clock() - t0) / n * 1e6

    return batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    p.add_argument("--device", choices=("standin", "cuda"), default="standin")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="host time as wall time (default) or the calling thread's CPU time",
    )
    p.add_argument(
        "--out",
        default="bench-results/capture.json",
        help="where the JSON results go (default bench-results/capture.json)",
    )
    args = p.parse_args()  # fmt: skip
    torch.set_num_threads(1)
    if args.device == "standin":
        import standin

        module = standin.load()
        device = standin.name()
    else:
        module, device = torch.cuda, "cuda"
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    results: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        for name, (model, inputs) in workloads(device).items():
            fns, seen = competitors(model, device)
            # The decode step rewrites the same cache position from the same input on every
            # call, so every call's result is eager's.
            want = model(*inputs)
            setup_s = {}
            for comp, fn in fns.items():  # compile, warm up, capture; check against eager
                t0 = time.perf_counter()
                for _ in range(3):
                    got = fn(*inputs)
                module.synchronize()
                setup_s[comp] = time.perf_counter() - t0
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

            def done(fn: Callable) -> Callable:
                def call(*xs: Any) -> None:
                    fn(*xs)
                    module.synchronize()

                return call

            host = measure(
                fns, inputs, args.rounds, clock=clock, batches={"own": own_replay(seen, clock)}
            )
            module.synchronize()
            completion = measure({k: done(f) for k, f in fns.items()}, inputs, args.rounds)
            results[name] = {"host": host, "done": completion, "setup_s": setup_s}
            print(f"{name}: host {host}  done {completion}", file=sys.stderr)
    lines = [
        "| workload | loop host us | replay host us | replay/loop host | replay's own host us "
        "| loop done us | replay done us | replay/loop done |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        h, d = r["host"], r["done"]
        lines.append(
            f"| {name} | {h['loop']:.1f} | {h['replay']:.1f} | {h['replay'] / h['loop']:.2f}x "
            f"| {h['own']:.1f} | {d['loop']:.1f} | {d['replay']:.1f} "
            f"| {d['replay'] / d['loop']:.2f}x |"
        )
    lines.append("")
    lines.append("first three calls (compile, warmup, capture), s: " + "; ".join(
        f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["setup_s"].items())
        for name, r in results.items()
    ))  # fmt: skip
    table = (
        "\n".join(lines) + f"\n\n({args.device}, {args.clock} clock for host, {args.rounds} rounds)"
    )
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"results": results, "table": table}, indent=1))
    print(f"(results written to {out})", file=sys.stderr)


if __name__ == "__main__":
    main()
