"""Small built-in models: the benchmark workloads (W1-W3), the demo, and the model tests.

* W1 ``OpChain``: 200 alternating add/mul/relu/sin ops on a 1x64 tensor (pure host overhead).
* W2 ``MLP``: batch-1 MLP, 4 x Linear(256) with GELU and LayerNorm.
* W3 ``DecoderBlock``: one pre-norm transformer decoder block (seq 16, hidden 128, 4 heads) with a
  causal attention mask; with ``cache_len`` set it also updates a KV cache in place.
* Branch-parallel blocks for multiple streams (``TwoStacks``, ``MoE``, ``ParallelResidual``),
  with their branches on a stream when built with ``manual=True``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .ops.streams import stream_scope


class OpChain(nn.Module):
    """W1: ``n`` cheap elementwise ops in a row; only dispatch cost matters."""

    def __init__(self, n: int = 200):
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n):
            k = i % 4
            if k == 0:
                x = x + 1.0
            elif k == 1:
                x = x * 0.5
            elif k == 2:
                x = torch.relu(x)
            else:
                x = torch.sin(x)
        return x


class MLP(nn.Module):
    """W2: Linear -> GELU -> LayerNorm, four times."""

    def __init__(self, dim: int = 256, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, norm in zip(self.layers, self.norms):
            x = norm(F.gelu(lin(x)))
        return x


class DecoderBlock(nn.Module):
    """W3: pre-norm attention + MLP with a causal mask.

    With ``cache_len`` the block keeps ``k_cache``/``v_cache`` buffers of that many positions and
    ``forward(x, pos)`` writes this step's keys and values at positions ``pos`` with
    ``index_copy_`` (an in-place input mutation under torch.compile), then attends over the cache.
    """

    def __init__(self, hidden: int = 128, heads: int = 4, cache_len: int | None = None):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.cache_len = cache_len
        if cache_len is not None:
            shape = (1, heads, cache_len, self.head_dim)
            self.register_buffer("k_cache", torch.zeros(shape))
            self.register_buffer("v_cache", torch.zeros(shape))

    def attention(self, x: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if pos is None:
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        else:
            self.k_cache.index_copy_(2, pos, k)
            self.v_cache.index_copy_(2, pos, v)
            k, v = self.k_cache, self.v_cache
            keys = torch.arange(self.cache_len, device=x.device)
            mask = keys[None, :] <= pos[:, None]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, s, h))

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.ln1(x), pos)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class KVCacheDecoder(nn.Module):
    """A small decoder-only transformer whose KV cache is passed in and updated in place.

    ``forward(x, k_cache, v_cache, pos)``: ``x`` is (batch, seq, hidden); the caches are
    (layers, batch, heads, max_len, head_dim); ``pos`` holds the ``seq`` positions being written.
    Each layer writes its keys and values into its slice of the caches with ``index_copy_`` and
    attends causally over everything up to each position. Batch and sequence length may vary from
    call to call (``dynamic=True``).
    """

    def __init__(self, hidden: int = 32, heads: int = 2, layers: int = 2, vocab: int = 50):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(hidden),
                    "qkv": nn.Linear(hidden, 3 * hidden),
                    "proj": nn.Linear(hidden, hidden),
                    "ln2": nn.LayerNorm(hidden),
                    "fc1": nn.Linear(hidden, 2 * hidden),
                    "fc2": nn.Linear(2 * hidden, hidden),
                }
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x, k_cache, v_cache, pos):
        b, s, h = x.shape
        keys = torch.arange(k_cache.shape[3], device=x.device)
        mask = keys[None, :] <= pos[:, None]  # (seq, max_len): causal over the cache
        for i, blk in enumerate(self.blocks):
            q, k, v = blk["qkv"](blk["ln1"](x)).split(h, dim=-1)
            q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            k_cache[i].index_copy_(2, pos, k)
            v_cache[i].index_copy_(2, pos, v)
            att = F.scaled_dot_product_attention(q, k_cache[i], v_cache[i], attn_mask=mask)
            x = x + blk["proj"](att.transpose(1, 2).reshape(b, s, h))
            x = x + blk["fc2"](F.gelu(blk["fc1"](blk["ln2"](x))))
        return self.head(x)

    def empty_cache(self, batch: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (len(self.blocks), batch, self.heads, max_len, self.head_dim)
        return torch.zeros(shape), torch.zeros(shape)


class TwoStacks(nn.Module):
    """Two independent stacks of ``depth`` Linear + GELU; ``manual`` puts one on a stream."""

    def __init__(self, dim: int = 256, depth: int = 16, manual: bool = False):
        super().__init__()
        self.manual = manual
        self.a = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.b = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    @staticmethod
    def stack(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = F.gelu(layer(x))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.manual:
            with stream_scope("b"):
                b = self.stack(self.b, x)
        else:
            b = self.stack(self.b, x)
        a = self.stack(self.a, x)
        return a + b


class MoE(nn.Module):
    """A dense mixture of experts: every expert runs, weighted by the router's softmax;
    ``manual`` puts half the experts on a stream."""

    def __init__(self, dim: int = 256, n_experts: int = 4, manual: bool = False):
        super().__init__()
        self.manual = manual
        self.router = nn.Linear(dim, n_experts)
        self.up = nn.ModuleList(nn.Linear(dim, 2 * dim) for _ in range(n_experts))
        self.down = nn.ModuleList(nn.Linear(2 * dim, dim) for _ in range(n_experts))

    def expert(self, i: int, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.down[i](F.gelu(self.up[i](x))) * gate[..., i : i + 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        n = len(self.up)
        if self.manual:  # half the experts on a side stream
            with stream_scope("experts"):
                side = [self.expert(i, x, gate) for i in range(n // 2, n)]
        else:
            side = [self.expert(i, x, gate) for i in range(n // 2, n)]
        out = sum(self.expert(i, x, gate) for i in range(n // 2))
        return out + sum(side)


class ParallelResidual(nn.Module):
    """A GPT-J style block, ``x + attn(ln(x)) + mlp(ln(x))``; ``manual`` puts the MLP on a
    stream."""

    def __init__(self, dim: int = 256, heads: int = 4, manual: bool = False):
        super().__init__()
        self.manual = manual
        self.ln = nn.LayerNorm(dim)
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        if self.manual:
            with stream_scope("mlp"):
                m = self.mlp(h)
        else:
            m = self.mlp(h)
        b, t, d = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        a = self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + a + m


def workloads() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    """The benchmark workloads W1-W3 as (model in eval mode, inputs), seeded."""
    torch.manual_seed(0)
    return {
        "W1 chain200": (OpChain(200).eval(), (torch.randn(1, 64),)),
        "W2 mlp": (MLP(256, 4).eval(), (torch.randn(1, 256),)),
        "W3 decoder": (DecoderBlock(128, 4).eval(), (torch.randn(1, 16, 128),)),
    }
