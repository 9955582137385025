"""Latency of the 2-rank tensor-parallel block (examples/tp_block.py): eager / aot_eager / fxrt.

Run it plainly and it launches itself under ``torchrun --nproc-per-node 2`` on 127.0.0.1 (gloo,
CPU); or run it under torchrun yourself. Each rank times every call of the block (grad off),
after a barrier and a warm-up; a row reports the median over calls of the slowest rank. Rank 0
prints a markdown table of median microseconds per call.

    python benchmarks/distributed.py [--iters 300] [--device cpu|cuda|npu]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(argv: list[str]) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        __file__,
        *argv,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples")])}
    return subprocess.call(cmd, env=env, timeout=900)


def _time_calls(fn, x, iters: int, sync) -> list[float]:
    import torch
    import torch.distributed as dist

    times = []
    with torch.no_grad():
        dist.barrier()
        for _ in range(iters):
            t0 = time.perf_counter()
            fn(x)
            sync()
            times.append(time.perf_counter() - t0)
    return times


def _run(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import torch.distributed as dist
    import tp_block

    import fxrt  # noqa: F401  (registers the "fxrt" backend)

    rank, world, dev = tp_block.init_distributed(args.device)
    try:
        ref, tp = tp_block.make_models(world, rank, dev)
        x = tp_block.make_input(dev)
        if dev.type == "cpu":
            sync = lambda: None
        else:
            sync = getattr(torch, dev.type).synchronize
        with torch.no_grad():
            expected = ref(x)
        variants = {
            "eager": tp,
            "aot_eager": torch.compile(tp, backend="aot_eager"),
            "fxrt (compiled loop)": torch.compile(tp, backend="fxrt"),
            "fxrt (Python loop)": torch.compile(tp, backend="fxrt", options={"pure_python": True}),
        }
        times: dict[str, list[float]] = {}
        for name, fn in variants.items():  # compile, check, warm up
            with torch.no_grad():
                torch.testing.assert_close(fn(x), expected, rtol=1e-4, atol=1e-5)
                for _ in range(args.warmup):
                    fn(x)
            times[name] = []
        # Interleave the variants in rounds, so a noisy neighbour hits them all alike.
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name] += _time_calls(fn, x, args.iters // args.rounds, sync)
        rows = []
        for name, ts in times.items():
            median = torch.tensor(statistics.median(ts) * 1e6)
            dist.all_reduce(median, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            rows.append((name, median.item()))
        if rank == 0:
            eager = rows[0][1]
            print(f"\n{world}-rank TP block, x {tuple(x.shape)}, {tp_block.BACKENDS[args.device]},")
            print(
                f"torch {torch.__version__}, median of {args.iters} calls per backend,"
                f" {args.rounds} interleaved rounds, slowest rank\n"
            )
            print("| backend | median us/call | vs eager |")
            print("|---|---:|---:|")
            for name, us in rows:
                print(f"| {name} | {us:.1f} | {us / eager:.2f}x |")
        return 0
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda", "npu"], default="cpu")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        return _launch(argv)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
