"""``python -m fxrt demo``: compile a small transformer block with fxrt and compare with eager."""

from __future__ import annotations

import statistics
import time
import warnings

import torch

import fxrt
from fxrt.compiler import CompiledGraph
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

    built: list[CompiledGraph] = []
    import fxrt.compiler as compiler

    original = compiler.compile_graph
    compiler.compile_graph = lambda *a, **k: built.append(original(*a, **k)) or built[-1]
    try:
        with torch.inference_mode():
            fx_model = torch.compile(model, backend="fxrt")
            out = fx_model(x)
    finally:
        compiler.compile_graph = original

    cg = built[0]
    print("== fxrt program of a transformer decoder block (seq 16, hidden 128, 4 heads) ==")
    print(cg.program)
    print(f"\nexecutor: {cg.executor}; predicted peak of intermediates: {cg.plan.peak_bytes} bytes")

    with torch.inference_mode():
        torch.testing.assert_close(out, model(x))
        contenders = {
            "eager": model,
            "aot_eager": torch.compile(model, backend="aot_eager"),
            "inductor": torch.compile(model, backend="inductor"),
            "fxrt": fx_model,
        }
        print("\n== latency per call (median of 15 rounds x 50 calls, one thread) ==")
        times = {}
        for name, fn in contenders.items():
            torch.testing.assert_close(fn(x), out, rtol=1e-4, atol=1e-4)
            times[name] = _median_us(fn, (x,))
        print(f"{'backend':<12}{'µs/call':>10}{'vs eager':>10}")
        for name, us in times.items():
            print(f"{name:<12}{us:>10.1f}{us / times['eager']:>9.2f}x")
    print("\n(outputs of every backend equal eager's; fxrt runtime:", fxrt.__version__, ")")
    return 0
