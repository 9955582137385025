"""Many callers, one compiled graph: calls per second with 1, 2, 4 and 8 threads.

Workloads (tiny, host-bound, batch 1):

  decoder block   W3's DecoderBlock(128, 4) on 16 tokens, traced with make_fx and compiled with
                  fxrt.compile_graph, its compiled loop called directly (``cg.entry()``)
  gpt2            the client tier's tiny GPT-2 forward on 16 tokens through
                  ``torch.compile(backend="fxrt")`` (Dynamo's guards and frame included)

and, for each, eager (the model itself) as the reference: its Python runs under the GIL, so
threads cannot help it much.

Each thread calls the shared callable on inputs of its own, under ``torch.inference_mode()`` (a
per-thread mode), for ``--seconds`` after all threads are ready; the figure is the calls of all
threads per second. Rounds interleave the thread counts in a shuffled order; each figure is the
median over ``--rounds``. ``torch.set_num_threads(1)``: one intra-op thread per caller, so N
callers use N cores at most (this project's machines have two).

Usage: python benchmarks/threads.py [--rounds N] [--seconds S] [--threads 1,2,4,8]
                                    [--only "decoder block,gpt2"]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fxrt  # noqa: E402
from fxrt.models import DecoderBlock  # noqa: E402

Call = Callable[[int], Any]  # a thread's call, given its index


def decoder_block() -> dict[str, Call]:
    torch.manual_seed(0)
    model = DecoderBlock(128, 4).eval()
    xs = [torch.randn(1, 16, 128) for _ in range(8)]
    with torch.inference_mode():
        gm = make_fx(model)(xs[0])
    cg = fxrt.compile_graph(gm, [xs[0]])
    run = cg.entry()
    with torch.inference_mode():
        torch.testing.assert_close(run([xs[1]]), model(xs[1]))
    return {"fxrt": lambda i: run([xs[i]]), "eager": lambda i: model(xs[i])}


def gpt2() -> dict[str, Call]:
    from clients_child import build, input_ids

    model = build("gpt2")
    ids = [input_ids(1, 16) for _ in range(8)]
    compiled = torch.compile(model, backend="fxrt")
    with torch.inference_mode():
        got = compiled(input_ids=ids[1]).logits
        torch.testing.assert_close(got, model(input_ids=ids[1]).logits)
    return {
        "fxrt": lambda i: compiled(input_ids=ids[i]),
        "eager": lambda i: model(input_ids=ids[i]),
    }


WORKLOADS = {"decoder block": decoder_block, "gpt2": gpt2}


def calls_per_second(call: Call, n: int, seconds: float) -> float:
    """All ``n`` threads' calls of ``call`` per second, over ``seconds`` after a common start."""
    counts = [0] * n
    ready = threading.Barrier(n + 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with torch.inference_mode():
                call(i)  # warm this thread's frame and arena
                ready.wait()
                k = 0
                while not stop.is_set():
                    call(i)
                    k += 1
                counts[i] = k
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            ready.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    ready.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.5)
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--only", default="", help="comma-separated workload names")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    counts = [int(n) for n in args.threads.split(",")]
    names = [w.strip() for w in args.only.split(",") if w.strip()] or list(WORKLOADS)
    rows = []
    for name in names:
        fns = WORKLOADS[name]()
        figures: dict[tuple[str, int], list[float]] = {}
        order = [(who, n) for who in fns for n in counts]
        for _ in range(args.rounds):
            random.shuffle(order)
            for who, n in order:
                rate = calls_per_second(fns[who], n, args.seconds)
                figures.setdefault((who, n), []).append(rate)
        for who in fns:
            med = {n: statistics.median(figures[(who, n)]) for n in counts}
            cells = [f"{med[n]:,.0f} ({med[n] / med[counts[0]]:.2f}x)" for n in counts]
            rows.append(f"| {name} | {who} | " + " | ".join(cells) + " |")
    head = "| workload | runs | " + " | ".join(f"{n} thread{'s' * (n > 1)}" for n in counts)
    print(head + " |")
    print("|---|---|" + "---|" * len(counts))
    print("\n".join(rows))
    print(
        f"\nCalls per second of all threads (median of {args.rounds} rounds of "
        f"{args.seconds} s), and the ratio to {counts[0]} thread(s); torch.set_num_threads(1)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
