"""Dynamic shapes: a KV-cache decoder called with varying sequence lengths, one compile each.

Competitors (all ``dynamic=True``): eager, aot_eager, inductor, fxrt. After a warm-up pass over
every length (compiles happen there; the number of graphs each backend compiled is reported), a
timed batch runs the whole cycle of lengths; batches of the competitors are interleaved and the
median over rounds is reported as µs per call, with ratios against eager.

Usage: python benchmarks/dynamic.py [--rounds N]
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from fxrt.bench import measure
from fxrt.models import KVCacheDecoder

LENGTHS = [1, 3, 7, 12, 16, 24, 31, 40, 48, 64]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=11)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = KVCacheDecoder(hidden=64, heads=4, layers=2).eval()
    calls = []
    for seq in LENGTHS:
        k, v = model.empty_cache(2, 64)
        calls.append((torch.randn(2, seq, 64), k, v, torch.arange(seq)))

    fns, graphs = {}, {}
    with torch.inference_mode():
        for name in ("eager", "aot_eager", "inductor", "fxrt"):
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            fn = model if name == "eager" else torch.compile(model, backend=name, dynamic=True)
            for a in calls:  # warm up: every compile happens here
                torch.testing.assert_close(fn(*a), model(*a), rtol=1e-4, atol=1e-4)
            graphs[name] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            fns[name] = lambda fn=fn: [fn(*a) for a in calls]
        per_cycle = measure(fns, (), args.rounds)
    us = {k: v / len(calls) for k, v in per_cycle.items()}
    print(f"KV-cache decoder, batch 2, sequence lengths {LENGTHS}, dynamic=True")
    print("| backend | µs/call | vs eager | vs aot_eager | graphs compiled |")
    print("|---|---|---|---|---|")
    for k, v in us.items():
        print(
            f"| {k} | {v:.1f} | {v / us['eager']:.2f}x | {v / us['aot_eager']:.2f}x "
            f"| {graphs[k] if k != 'eager' else '-'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
