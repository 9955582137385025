"""Cold compile vs warm-cache load, each in a fresh process.

For each model, a fresh process compiles it with ``torch.compile(backend="fxrt")`` against an
empty cache directory (cold), then another fresh process does the same against the filled cache
(warm). Reported: the time spent inside fxrt's backend (what the cache can remove: the ATen trace,
passes, planning and lowering; a warm load still converts Dynamo's graph to compute the key,
fingerprints it, and validates the entry and recomputes its plan and program), and
the whole first call (which also includes Dynamo's own tracing, which no backend cache removes).
Repeated ``--repeats`` times; medians.

Usage: python benchmarks/cache.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent("""
    import json, sys, time, torch, fxrt
    from torch import nn
    from fxrt.models import DecoderBlock
    torch.manual_seed(0)
    name = sys.argv[1]
    if name == "W3 decoder":
        model, x = DecoderBlock(128, 4).eval(), torch.randn(1, 16, 128)
    else:
        model = nn.Sequential(*[DecoderBlock(256, 8) for _ in range(8)]).eval()
        x = torch.randn(1, 32, 256)
    spent = []
    backend = fxrt.backend  # imports fxrt's modules now: import time is not compile time
    def timed_backend(gm, example_inputs, **kw):
        t0 = time.perf_counter()
        try:
            return backend(gm, example_inputs, **kw)
        finally:
            spent.append(time.perf_counter() - t0)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = torch.compile(model, backend=timed_backend)(x)
        first = time.perf_counter() - t0
        torch.testing.assert_close(out, model(x))
    print(json.dumps({"backend_s": sum(spent), "first_call_s": first,
                      "hits": fxrt.cache.stats["hit"], "compiled": fxrt.cache.stats["compiled"]}))
""")

MODELS = ["W3 decoder", "8x decoder(256)"]


def run(name: str, cache_dir: str) -> dict:
    env = {**os.environ, "FXRT_CACHE_DIR": cache_dir}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, name], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print("| model | fxrt compile, cold | warm load | warm/cold | first call, cold | warm |")
    print("|---|---|---|---|---|---|")
    for name in MODELS:
        cold, warm = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as d:
                c, w = run(name, d), run(name, d)
                assert c["compiled"] >= 1 and c["hits"] == 0, c
                assert w["compiled"] == 0 and w["hits"] >= 1, w
                cold.append(c)
                warm.append(w)
        med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
        cb, wb = med(cold, "backend_s"), med(warm, "backend_s")
        print(
            f"| {name} | {cb * 1e3:.0f} ms | {wb * 1e3:.0f} ms | {wb / cb:.2f}x "
            f"| {med(cold, 'first_call_s'):.2f} s | {med(warm, 'first_call_s'):.2f} s |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
