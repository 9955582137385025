"""``python -m fxrt demo``: a small transformer block through fxrt, next to eager PyTorch.

Shows the compiled program (with its FREEs), the latency against eager / aot_eager / inductor,
where fxrt's time goes (``fxrt.profile()``), and the planned memory with a plot.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.exec.memory import memory_report
from fxrt.models import DecoderBlock


def _median_us(fn, inputs, rounds: int = 15, calls: int = 50) -> float:
    for _ in range(5):
        fn(*inputs)
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*inputs)
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> int:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DecoderBlock(hidden=128, heads=4).eval()
    x = torch.randn(1, 16, 128)

    with torch.inference_mode():
        expected = model(x)
        # The graph without Dynamo: parameters become constants the program owns.
        cg = fxrt.compile_graph(make_fx(model)(x), [x])
        torch.testing.assert_close(cg(x), expected)
        print("== fxrt program of a transformer decoder block (seq 16, hidden 128, 4 heads) ==")
        print(cg.program)

        contenders = {
            "eager": model,
            "aot_eager": torch.compile(model, backend="aot_eager"),
            "inductor": torch.compile(model, backend="inductor"),
            "fxrt": torch.compile(model, backend="fxrt"),
            f"fxrt loop ({cg.executor}, no Dynamo)": cg,
        }
        print("\n== latency per call (median of 15 rounds x 50 calls, one thread) ==")
        times = {}
        for name, fn in contenders.items():
            torch.testing.assert_close(fn(x), expected, rtol=1e-4, atol=1e-4)
            times[name] = _median_us(fn, (x,))
        width = max(map(len, times))
        print(f"{'backend':<{width}}  {'µs/call':>9}  {'vs eager':>8}")
        for name, us in times.items():
            print(f"{name:<{width}}  {us:>9.1f}  {us / times['eager']:>7.2f}x")

        print("\n== where fxrt's time goes (fxrt.profile(), 20 calls) ==")
        with fxrt.profile() as prof:
            for _ in range(20):
                cg(x)
        print(prof.table(top=10))

        report = memory_report(cg, [x])
    print(f"\n== memory: planned peak {report.peak_bytes} B after node {report.peak_node} ==")
    print(f"(measured on a replay: {max(report.measured)} B) made of:")
    for value, nbytes in report.peak_values[:5]:
        print(f"  %{value}: {nbytes} B")
    if report.arena_bytes:
        print(
            f"{report.arena_values} intermediates live in a {report.arena_bytes} B arena, "
            "kept from call to call"
        )
    try:
        path = report.plot(os.path.abspath("fxrt-demo-memory.png"))
        print(f"memory plot written to {path}")
    except ImportError as e:
        print(f"(no memory plot: {e})")
    print(f"\nevery backend's output equals eager's; {fxrt.runtime_info()['reason']}")
    return 0
