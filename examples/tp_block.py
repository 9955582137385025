"""Tensor-parallel transformer block compiled with fxrt, on every rank.

A pre-norm transformer block (causal self-attention + GELU MLP) is sharded Megatron-style across
the ranks of the default process group:

* attention: the q/k/v projection is split by columns (each rank owns ``heads / world`` heads),
  the output projection by rows; one ``all_reduce`` sums the partial outputs;
* MLP: ``fc1`` split by columns, ``fc2`` by rows; one more ``all_reduce``.

The forward uses functional collectives (``torch.distributed._functional_collectives``), which
Dynamo captures as ``_c10d_functional.all_reduce`` + ``wait_tensor``; fxrt runs them as native
instructions on its compiled loop (``pure_python=False``) and through the Python loop otherwise.
Every rank checks its output against the unsharded block (same seed, so same weights and input)
and prints the result.

Run (CPU, gloo)::

    torchrun --nproc-per-node 2 examples/tp_block.py

On GPUs or Ascend NPUs the same code runs on NCCL or HCCL (``--device cuda`` / ``--device npu``;
``torch_npu`` must import for the latter). The module is importable: the tests and
``benchmarks/distributed.py`` reuse :class:`Block`, :class:`TPBlock` and :func:`init_distributed`.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class Block(nn.Module):
    """The unsharded reference: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, dim: int = 64, heads: int = 4, hidden: int = 256):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(_attention(self.qkv(self.ln1(x)), self.heads))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    b, s, three_d = qkv.shape
    q, k, v = qkv.view(b, s, 3, heads, three_d // (3 * heads)).permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(b, s, three_d // 3)


class TPBlock(nn.Module):
    """Rank ``rank``'s shard of a :class:`Block`: column-parallel qkv/fc1, row-parallel proj/fc2."""

    def __init__(self, ref: Block, rank: int, world: int, group: dist.ProcessGroup | None = None):
        super().__init__()
        dim, hidden = ref.proj.in_features, ref.fc1.out_features
        if ref.heads % world or hidden % world:
            raise ValueError(f"heads ({ref.heads}) and hidden ({hidden}) must divide by {world}")
        self.heads = ref.heads // world
        self.group = group if group is not None else dist.group.WORLD
        d, h = dim // world, hidden // world
        cols = slice(rank * d, (rank + 1) * d)
        # qkv's rows are [q; k; v], each head-major: take this rank's heads from each of the three.
        rows = torch.cat([torch.arange(dim)[cols] + i * dim for i in range(3)])
        self.ln1, self.ln2 = ref.ln1, ref.ln2
        self.qkv = _linear(ref.qkv.weight[rows], ref.qkv.bias[rows])
        self.proj = _linear(ref.proj.weight[:, cols], None)  # bias added once, after the reduce
        self.proj_bias = nn.Parameter(ref.proj.bias.detach().clone())
        self.fc1 = _linear(
            ref.fc1.weight[rank * h : (rank + 1) * h], ref.fc1.bias[rank * h : (rank + 1) * h]
        )
        self.fc2 = _linear(ref.fc2.weight[:, rank * h : (rank + 1) * h], None)
        self.fc2_bias = nn.Parameter(ref.fc2.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.proj(_attention(self.qkv(self.ln1(x)), self.heads))
        x = x + funcol.all_reduce(a, "sum", self.group) + self.proj_bias
        m = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x + funcol.all_reduce(m, "sum", self.group) + self.fc2_bias


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out_f, in_f = weight.shape
    lin = nn.Linear(in_f, out_f, bias=bias is not None, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def init_distributed(device: str = "cpu", timeout_s: float = 60.0) -> tuple[int, int, torch.device]:
    """Join the default process group from torchrun's environment (RANK, WORLD_SIZE, ...)."""
    if device == "npu":
        import torch_npu  # noqa: F401  (registers the npu device and the hccl backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device(device, local_rank) if device != "cpu" else torch.device("cpu")
    if device != "cpu":
        getattr(torch, device).set_device(dev)
    dist.init_process_group(BACKENDS[device], timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), dev


def make_models(
    world: int, rank: int, device: torch.device, seed: int = 0
) -> tuple[Block, TPBlock]:
    """The reference block (same weights on every rank: same seed) and this rank's shard."""
    torch.manual_seed(seed)
    ref = Block().to(device).eval()
    return ref, TPBlock(ref, rank, world).eval()


def make_input(device: torch.device, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 16, 64, generator=g).to(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=sorted(BACKENDS), default="cpu")
    parser.add_argument("--pure-python", action="store_true", help="fxrt's Python loop")
    args = parser.parse_args(argv)
    rank, world, dev = init_distributed(args.device)
    try:
        ref, tp = make_models(world, rank, dev)
        x = make_input(dev)
        compiled = torch.compile(tp, backend="fxrt", options={"pure_python": args.pure_python})
        with torch.no_grad():
            expected = ref(x)
            got = compiled(x)
        ok = torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
        err = (got - expected).abs().max().item()
        loop = "python" if args.pure_python else "cpp"
        print(
            f"rank {rank}/{world} [{BACKENDS[args.device]}, fxrt {loop} loop]: TP output "
            f"{'equals' if ok else 'DIFFERS FROM'} the unsharded model's (max abs err {err:.2e})",
            flush=True,
        )
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
