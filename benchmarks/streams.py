"""Multi-stream execution on the CPU: single stream vs manual scopes vs ``streams="auto"``.

Compiled loop, one intra-op thread per stream (``torch.set_num_threads(1)``), batch 1:

* (a) two independent host-bound branches: two stacks of 16 ``Linear(256)`` + GELU;
* (b) a 4-expert MoE block computed densely (batch 1 and 4);
* (c) a parallel-residual decoder block (attention and MLP side by side);
* W1-W3 (``fxrt.models.workloads()``) with ``streams="auto"`` against the default.

"single" is the manual model compiled with ``streams="off"`` (its scopes removed), "manual" the
same model with its ``fxrt.stream_scope`` blocks, "auto" the plain model with
``streams="auto"``. Each is run two ways, in the same interleaved rounds: through
``torch.compile`` (Dynamo's per-call work, frame evaluation, guards and gathering the parameters,
runs before the graph on the caller's thread, the same in all three), and through
``fxrt.export``/``fxrt.load`` (the runtime alone: what the streams change). Times are medians
over rounds of the per-call time; ``--clock cpu`` measures process CPU time instead of wall time
(all threads: what the hand-off costs in work, not latency).

Usage: python benchmarks/streams.py [--rounds N] [--calls N] [--clock wall|cpu] [--json out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fxrt  # noqa: E402
from fxrt.models import MoE, ParallelResidual, TwoStacks, workloads  # noqa: E402


def compile_fxrt(model: nn.Module, **options) -> Callable:
    torch._dynamo.reset()
    return torch.compile(model, backend="fxrt", options={"cache": False, **options})


def load_fxrt(model: nn.Module, inputs: tuple, tmp: Path, **options) -> Callable:
    path = tmp / f"{len(list(tmp.iterdir()))}.fxrt"
    fxrt.export(model, inputs, options=options).save(path)
    return fxrt.load(path)


def measure(
    fns: dict[str, Callable], inputs: tuple, rounds: int, calls: int, clock: Callable
) -> dict[str, float]:
    """Per variant, the median over rounds of the time per call in microseconds. The variants
    take turns within each round (in a rotating order), so that a shared, noisy machine slows
    them alike."""
    names = list(fns)
    per_call: dict[str, list[float]] = {k: [] for k in names}
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(20):
                fn(*inputs)
        for r in range(rounds):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                fn = fns[k]
                t0 = clock()
                for _ in range(calls):
                    fn(*inputs)
                per_call[k].append((clock() - t0) / calls * 1e6)
    return {k: statistics.median(v) for k, v in per_call.items()}


def machine_parallelism(clock: Callable = time.perf_counter) -> float:
    """Time two threads take for two loads of matrix products, over the time one thread takes
    for one: 1.0 on two free cores, 2.0 when only one is free (what the figures should be read
    against on a shared machine)."""
    # Products large enough that the GIL, held between them, is not what limits two threads.
    w, x = torch.randn(512, 512), torch.randn(64, 512)

    def work(n: int = 200) -> None:
        torch.set_num_threads(1)
        for _ in range(n):
            torch.mm(x, w)

    work()
    t0 = clock()
    work()
    one = clock() - t0
    threads = [threading.Thread(target=work) for _ in range(2)]
    t0 = clock()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (clock() - t0) / one


def cases() -> dict[str, tuple[Callable[[bool], nn.Module], tuple]]:
    return {
        "(a) two stacks 16x Linear(256)+GELU, b1": (
            lambda m: TwoStacks(manual=m),
            (torch.randn(1, 256),),
        ),
        "(b) MoE 4 experts dense, b1": (lambda m: MoE(manual=m), (torch.randn(1, 256),)),
        "(b) MoE 4 experts dense, b4": (lambda m: MoE(manual=m), (torch.randn(4, 256),)),
        "(c) parallel-residual block, b1 t8": (
            lambda m: ParallelResidual(manual=m),
            (torch.randn(1, 8, 256),),
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    info = fxrt.runtime_info()
    assert info["executor"] == "cpp", f"the compiled loop is needed: {info['reason']}"
    results: dict[str, dict[str, float]] = {}
    par = statistics.median(machine_parallelism() for _ in range(5))
    print(
        f"clock {args.clock}, {args.rounds} rounds x {args.calls} calls, us per call (median); "
        f"two threads doing twice the work take {par:.2f}x one thread's time "
        "(1.0: two free cores, 2.0: one)"
    )
    head = f"{'single':>9} {'manual':>9} {'auto':>9} {'man/single':>10} {'auto/single':>11}"
    print(f"{'case':<40} {'through':<13} {head}")
    tmp = Path(tempfile.mkdtemp(prefix="fxrt-streams-"))
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.export's pytree notice
    for name, (make, inputs) in cases().items():
        torch.manual_seed(0)
        manual = make(True).eval()
        plain = make(False).eval()
        plain.load_state_dict(manual.state_dict())
        fns = {
            "single": compile_fxrt(manual, streams="off"),
            "manual": compile_fxrt(manual),
            "auto": compile_fxrt(plain, streams="auto"),
            "single[load]": load_fxrt(manual, inputs, tmp, streams="off"),
            "manual[load]": load_fxrt(manual, inputs, tmp),
            "auto[load]": load_fxrt(plain, inputs, tmp, streams="auto"),
        }
        with torch.no_grad():
            want = plain(*inputs)
            for fn in fns.values():
                torch.testing.assert_close(fn(*inputs), want)
        row = measure(fns, inputs, args.rounds, args.calls, clock)
        results[name] = row
        for through, tag in (("torch.compile", ""), ("fxrt.load", "[load]")):
            single, man, auto = (row[k + tag] for k in ("single", "manual", "auto"))
            print(
                f"{name:<40} {through:<13} {single:>9.1f} {man:>9.1f} {auto:>9.1f} "
                f"{man / single:>10.2f} {auto / single:>11.2f}"
            )
    print(f"\n{'workload':<40} {'through':<13} {'default':>9} {'auto':>9} {'auto/default':>12}")
    for name, (model, inputs) in workloads().items():
        fns = {
            "default": compile_fxrt(model),
            "auto": compile_fxrt(model, streams="auto"),
            "default[load]": load_fxrt(model, inputs, tmp),
            "auto[load]": load_fxrt(model, inputs, tmp, streams="auto"),
        }
        row = measure(fns, inputs, args.rounds, args.calls, clock)
        results[name] = row
        for through, tag in (("torch.compile", ""), ("fxrt.load", "[load]")):
            default, auto = row["default" + tag], row["auto" + tag]
            print(f"{name:<40} {through:<13} {default:>9.1f} {auto:>9.1f} {auto / default:>12.3f}")
    results["machine_parallelism"] = {"two_threads_vs_one": par}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
