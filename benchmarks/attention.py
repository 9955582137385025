"""fxrt::attention against ATen's flash kernel (what ``scaled_dot_product_attention`` runs on the
CPU), op against op: prompts (causal, queries = keys) and decoding steps (one query over a cache),
grouped-query heads, query/key/value laid out as models make them ([B, L, H, D] seen through a
transpose).

Both ops are called through the dispatcher on the same tensors, side by side in shuffled,
interleaved rounds (``fxrt.bench.measure``); each figure is the median µs per call, and the ratio
is ATen's over fxrt's. ``--threads`` sets the intra-op threads (default 1, as the other benchmarks;
above two, fxrt::attention hands problems of more than 2^18 multiply-adds to ATen's kernel, which
shares the heads among the threads).

Usage: python benchmarks/attention.py [--rounds N] [--threads T]
"""

from __future__ import annotations

import argparse

import torch

import fxrt
from fxrt.bench import measure

# (batch, query heads, key/value heads, queries, keys, features)
SHAPES = [
    (1, 4, 2, 16, 16, 16),
    (4, 4, 2, 16, 16, 16),
    (1, 4, 2, 128, 128, 16),
    (4, 4, 2, 128, 128, 16),
    (1, 4, 2, 128, 128, 64),
    (1, 8, 8, 256, 256, 64),
    (1, 32, 8, 512, 512, 128),
    (1, 4, 2, 1, 128, 16),
    (1, 4, 4, 1, 512, 64),
    (1, 32, 8, 1, 2048, 128),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fxrt.runtime_info()  # loads the extension, which registers fxrt's ops
    if not hasattr(torch.ops.fxrt, "attention"):
        raise SystemExit("fxrt's compiled extension is not built: run `make .venv/.fxrt` first")
    aten = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    own = torch.ops.fxrt.attention.default
    print(f"intra-op threads: {args.threads}; median µs per call over {args.rounds} rounds\n")
    print("| B, H, Hk, L, S, D | causal | ATen | fxrt | ATen/fxrt | largest difference |")
    print("|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for b, h, hk, lq, s, d in SHAPES:
        q = torch.randn(b, lq, h, d).transpose(1, 2)
        k = torch.randn(b, s, hk, d).transpose(1, 2)
        v = torch.randn(b, s, hk, d).transpose(1, 2)
        causal = lq == s
        with torch.inference_mode():
            inputs = (q, k, v, 0.0, causal)
            us = measure({"aten": aten, "fxrt": own}, inputs, args.rounds)
            diff = (aten(q, k, v, 0.0, causal)[0] - own(q, k, v, 0.0, causal)[0]).abs().max()
        print(
            f"| {b}, {h}, {hk}, {lq}, {s}, {d} | {causal} | {us['aten']:.1f} | {us['fxrt']:.1f} | "
            f"{us['aten'] / us['fxrt']:.2f}x | {diff.item():.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
