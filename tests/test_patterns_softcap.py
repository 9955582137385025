"""Soft-capped attention (Gemma-2's ``softcap * tanh(scores / softcap)`` before the mask):
fxrt.passes.fuse_attention makes one ``fxrt::softcap_sdpa`` call of it, and the
``gqa_softcap_attention`` pattern has that call read un-repeated K/V heads.

* the op against eager's chain on random and adversarial inputs (prompts, decoding steps, a few
  queries, features that are not a multiple of the vector width, grouped-query heads, causal and
  added masks), the bound docs/numerics.md states; off its fast path (bfloat16, autograd, a row
  every key of which is masked) it is eager's chain; bad arguments are named;
* hand-written blocks through ``torch.compile`` on both loops, each called twice with different
  values: the fused call, and the chains that must keep their ops;
* Gemma-2 from ``transformers`` end to end is in the client tier (tests/test_clients.py), its
  package through fxrt.load and the C++ runtime in tests/test_deploy_cpp.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import native_available
from test_patterns import adversarial, compile_twice, x_input
from torch import nn

import fxrt

pytestmark = pytest.mark.skipif(
    not native_available(), reason="fxrt's own ops need the compiled extension"
)


def own():
    fxrt.runtime_info()  # loads the extension, which registers the op
    return torch.ops.fxrt.softcap_sdpa


def eager(q, k, v, cap, causal=False, mask=None, scale=None):
    """Gemma-2's attention as transformers writes it (K/V heads repeated)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    w = torch.matmul(q, k.transpose(-2, -1)) * s
    w = torch.tanh(w / cap) * cap
    if causal:
        later = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
        w = w.masked_fill(later, -math.inf)
    if mask is not None:
        w = w + mask
    return torch.matmul(torch.softmax(w, -1, dtype=torch.float32).to(q.dtype), v)


SHAPES = [
    (1, 4, 2, 20, 20, 16, True),  # a prompt: keys in tiles
    (1, 4, 2, 20, 20, 16, False),
    (1, 8, 2, 1, 40, 64, False),  # a decoding step: a group's heads as the rows
    (2, 4, 2, 3, 50, 32, False),  # a few queries: rows' dot products
    (1, 4, 4, 1, 33, 20, False),  # features not a multiple of the vector width
]


@pytest.mark.parametrize("b, h, hk, lq, s, d, causal", SHAPES)
@pytest.mark.parametrize("operand", ["q", "k", "v"])
def test_softcap_op_within_bound_of_eager(b, h, hk, lq, s, d, causal, operand):
    """2e-6 of the largest value's magnitude (or of 1), NaN and Inf where eager has them; with
    and without an added mask; the out= overload writes the same values."""
    g = torch.Generator().manual_seed(3)
    base = {
        "q": torch.randn(b, h, lq, d, generator=g) * 4,
        "k": torch.randn(b, hk, s, d, generator=g) * 4,
        "v": torch.randn(b, hk, s, d, generator=g),
    }
    shape = base[operand].shape
    variants = adversarial((*shape[:-2], max(shape[-2], 3), shape[-1]))
    masks = [None, torch.randn(lq, s, generator=g)]
    for x in (x[..., : shape[-2], :] for x in variants):
        q, k, v = (x if name == operand else t for name, t in base.items())
        bound = 2e-6 * max(v[v.isfinite()].abs().max().item(), 1.0)
        for mask in masks:
            expected = eager(q, k, v, 20.0, causal, mask, 0.25)
            got = own()(q, k, v, 20.0, causal, attn_mask=mask, scale=0.25)
            torch.testing.assert_close(got, expected, rtol=0, atol=bound, equal_nan=True)
            assert got.stride() == torch.empty_like(q).stride()  # the query's, as fxrt::sdpa
            out = torch.empty_like(q)
            own().out(q, k, v, 20.0, causal, attn_mask=mask, scale=0.25, out=out)
            torch.testing.assert_close(out, got, rtol=0, atol=0, equal_nan=True)


def test_softcap_op_follows_eager_off_the_fast_path():
    """bfloat16, autograd and a row every key of which is masked are eager's chain (NaN rows as
    eager's softmax gives them, where fxrt::attention's ATen semantics would give zeros)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 6, 16, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    torch.testing.assert_close(own()(*bf, 30.0, True), eager(*bf, 30.0, True), rtol=0, atol=0)
    qg = q.clone().requires_grad_()
    own()(qg, k, v, 30.0).sum().backward()
    expected = torch.autograd.grad(eager(qg, k, v, 30.0).sum(), qg)[0]
    torch.testing.assert_close(qg.grad, expected)
    mask = torch.zeros(6, 6)
    mask[2] = -math.inf
    got, want = own()(q, k, v, 30.0, attn_mask=mask), eager(q, k, v, 30.0, mask=mask)
    assert got[:, :, 2].isnan().all() and want[:, :, 2].isnan().all()
    torch.testing.assert_close(got, want, equal_nan=True)


def test_softcap_op_names_bad_arguments():
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 3, 6, 16)
    with pytest.raises(RuntimeError, match=r"softcap must be a finite non-zero number, got 0"):
        own()(q, q, q, 0.0)
    with pytest.raises(RuntimeError, match=r"query's heads \(4\) must be a multiple of the key's"):
        own()(q, k, k, 30.0)
    with pytest.raises(RuntimeError, match=r"out has sizes \[1, 4, 6, 8\]"):
        own().out(q, q, q, 30.0, out=torch.empty(1, 4, 6, 8))


# --- hand-written blocks ------------------------------------------------------------------------


class CappedAttention(nn.Module):
    """Gemma-2's eager attention: q/k/v projections, repeat_kv, scores scaled and soft-capped,
    a causal (or sliding-window) mask added, softmax in float32, dropout, the heads merged."""

    def __init__(self, kv_heads=2, window=None, spelling="div", keep=False):
        super().__init__()
        self.kv, self.window, self.spelling, self.keep = kv_heads, window, spelling, keep
        self.qkv = nn.Linear(64, 64 + 2 * 16 * kv_heads)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([64, 16 * self.kv, 16 * self.kv], -1)
        q = q.view(b, s, 4, 16).transpose(1, 2)
        k, v = (t.view(b, s, self.kv, 16).transpose(1, 2) for t in (k, v))
        n = 4 // self.kv
        if n > 1:  # transformers' repeat_kv
            k, v = (t[:, :, None].expand(b, self.kv, n, s, 16).reshape(b, 4, s, 16) for t in (k, v))
        w = torch.matmul(q, k.transpose(2, 3)) * 0.25
        capped = torch.tanh(w * (1 / 32.0) if self.spelling == "mul" else w / 50.0)
        w = capped * (32.0 if self.spelling == "mul" else 40.0 if self.spelling == "odd" else 50.0)
        mask = torch.full((s, s), -math.inf).triu(1)
        if self.window is not None:
            mask = mask + torch.full((s, s), -math.inf).tril(-self.window)
        w = w + mask
        p = nn.functional.dropout(torch.softmax(w, -1, dtype=torch.float32), 0.0, False)
        out = torch.matmul(p.to(q.dtype), v).transpose(1, 2).reshape(b, s, 64)
        return (out, capped) if self.keep else out


def run_twice(model, executor, **options):
    """``model`` through torch.compile on ``executor``, called on two different inputs, each
    equal to eager; its pattern counts and how many fxrt::softcap_sdpa calls it runs."""
    programs = []
    counts = compile_twice(model, x_input(2, 9, 64), executor, programs, **options)
    assert len(programs) == 1
    return counts, str(programs[0]).count("fxrt::softcap_sdpa(")


@pytest.mark.parametrize("window", [None, 4], ids=["causal", "sliding"])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_capped_attention_fuses(kv_heads, window, executor):
    counts, calls = run_twice(CappedAttention(kv_heads, window), executor)
    assert calls == 1
    assert counts == ({"gqa_softcap_attention": 1} if kv_heads == 2 else {})


def test_reciprocal_spelling_fuses(executor):
    """``tanh(w * (1 / c)) * c``, where ``1 / c`` is exact, is the same soft cap."""
    assert run_twice(CappedAttention(spelling="mul"), executor)[1] == 1


@pytest.mark.parametrize(
    "case, model, options",
    [
        ("caps differ", CappedAttention(spelling="odd"), {}),  # tanh(w / 50) * 40: not a cap
        ("tanh returned", CappedAttention(keep=True), {}),  # the caller receives an intermediate
        ("own ops off", CappedAttention(), {"own_ops": False}),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_capped_attention_left_alone(case, model, options, executor):
    counts, calls = run_twice(model, executor, **options)
    assert (counts, calls) == ({}, 0), case


def test_softcap_pattern_turns_off_by_name(executor):
    counts, calls = run_twice(
        CappedAttention(), executor, disable_patterns=["gqa_softcap_attention"]
    )
    assert (counts, calls) == ({}, 1)  # fused, reading the repeated heads
