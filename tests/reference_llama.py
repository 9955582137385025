"""Decoders written the way reference code writes them, outside ``transformers``: Meta's Llama
(rotary embeddings as a complex product, ``repeat_kv`` before the heads' transpose, attention by
hand with an additive mask) and the real-pair rotary of gpt-fast-style code. The fused-pattern
tests and ``benchmarks/llm.py`` compile them as a user would.

``Llama(rope="complex")`` is Meta's ``model.py`` with small sizes; ``rope="pairs"`` swaps in the
real-pair rotation over a float32 ``(cos, sin)`` cache and ``attention="sdpa"`` the
``scaled_dot_product_attention`` call later reference code (torchtitan) makes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))


def reshape_for_broadcast(freqs_cis, x):
    shape = [d if i == 1 or i == x.ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    """Meta's: the pairs of features as complex numbers times the complex frequencies."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def apply_rotary_pairs(x, freqs):
    """gpt-fast's: the same product multiplied out on a real (cos, sin) cache."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs = freqs.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack(
        [
            xs[..., 0] * freqs[..., 0] - xs[..., 1] * freqs[..., 1],
            xs[..., 1] * freqs[..., 0] + xs[..., 0] * freqs[..., 1],
        ],
        -1,
    )
    return out.flatten(3).type_as(x)


def repeat_kv(x, n_rep: int):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv: int, rope: str, attention: str):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, dim // n_heads
        self.rope, self.attention = rope, attention
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs, mask):
        b, n, _ = x.shape
        xq = self.wq(x).view(b, n, self.n_heads, self.head_dim)
        xk = self.wk(x).view(b, n, self.n_kv, self.head_dim)
        xv = self.wv(x).view(b, n, self.n_kv, self.head_dim)
        if self.rope == "complex":
            xq, xk = apply_rotary_emb(xq, xk, freqs)
        else:
            xq, xk = apply_rotary_pairs(xq, freqs), apply_rotary_pairs(xk, freqs)
        rep = self.n_heads // self.n_kv
        keys, values = repeat_kv(xk, rep), repeat_kv(xv, rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(xq, keys, values, is_causal=True)
        else:
            scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
            scores = scores + mask
            scores = F.softmax(scores.float(), dim=-1).type_as(xq)
            out = torch.matmul(scores, values)
        return self.wo(out.transpose(1, 2).contiguous().view(b, n, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv: int, hidden: int, rope: str, attention: str):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv, rope, attention)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)

    def forward(self, x, freqs, mask):
        h = x + self.attention(self.attention_norm(x), freqs, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Meta's Llama ``Transformer`` (no KV cache): tokens in, float32 logits out."""

    def __init__(
        self,
        layers: int = 2,
        dim: int = 64,
        n_heads: int = 4,
        n_kv: int = 2,
        vocab: int = 128,
        hidden: int = 128,
        max_seq: int = 128,
        rope: str = "complex",
        attention: str = "manual",
    ):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            Block(dim, n_heads, n_kv, hidden, rope, attention) for _ in range(layers)
        )
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        freqs = precompute_freqs_cis(dim // n_heads, max_seq * 2)
        # a plain attribute, as Meta's code keeps it: .to(dtype) leaves it complex64 / float32
        self.freqs = freqs if rope == "complex" else torch.view_as_real(freqs).contiguous()

    def forward(self, tokens):
        n = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs = self.freqs[:n]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1).type_as(h)
        for layer in self.layers:
            h = layer(h, freqs, mask)
        return self.output(self.norm(h)).float()


def tokens(batch: int, seq: int, seed: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
