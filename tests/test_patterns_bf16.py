"""Fused patterns on bfloat16 (fxrt.patterns, fxrt/_speedups/own_decoder.h): the ops against
eager's bfloat16 chains (the bounds docs/patterns.md states), which chains fuse (a norm widened
to float32 as models write it; never one rounding each step to bfloat16), and decoder blocks
through ``torch.compile`` on both loops against eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import native_available, recording_compiles, skip_unless_executor
from test_patterns import adversarial as float_cases
from torch import nn

import fxrt

pytestmark = pytest.mark.skipif(
    not native_available(), reason="fxrt's own ops need the compiled extension"
)
BF16 = torch.bfloat16
ULP = 2.0**-7  # one bfloat16 ulp, relative (8 bits of precision)


def own(name: str):
    fxrt.runtime_info()  # loads the extension, which registers the ops
    return getattr(torch.ops.fxrt, name)


def widened_rms(x, w=None, eps=1e-6, outside=False):
    """Llama's RMSNorm on a bfloat16 x: the norm of x.float(), cast back, times the weight."""
    xf = x.float()
    ms = xf.pow(2).mean(-1, keepdim=True)
    y = (xf / (ms.sqrt() + eps) if outside else xf * torch.rsqrt(ms + eps)).to(x.dtype)
    return y if w is None else w * y


def adversarial(shape: tuple[int, ...]) -> list[torch.Tensor]:
    """test_patterns' random, large, denormal, zero-row and NaN/Inf cases, in bfloat16."""
    return [c.to(BF16) for c in float_cases(shape)]


def within_ulps(got, expected, ulps):
    """Equal, NaN where eager's is, and finite values within ``ulps`` bfloat16 ulps."""
    torch.testing.assert_close(
        got.float(), expected.float(), rtol=ulps * ULP, atol=1e-30, equal_nan=True
    )


@pytest.mark.parametrize("outside", [False, True])
@pytest.mark.parametrize("seed", [0, 1248])
def test_rms_norm_is_the_widened_norm_within_two_ulps(outside, seed):
    """The norm in float32 rounds to bfloat16 within one ulp of the widened chain's; the
    weight's bfloat16 product of a value one ulp apart can round two apart (seed 1248: the
    residual norm's element (0, 1, 56) of the random case, without ``eps`` outside)."""
    torch.manual_seed(seed)
    w = torch.randn(64).to(BF16)
    for x in adversarial((3, 5, 64)):
        got = own("rms_norm")(x, w, 1e-6, 0.0, outside)
        assert got.dtype is BF16
        within_ulps(got, widened_rms(x, w, 1e-6, outside), 2)
        out = torch.empty_like(x)
        own("rms_norm").out(x, w, 1e-6, 0.0, outside, out=out)
        torch.testing.assert_close(out, got, rtol=0, atol=0, equal_nan=True)
        r = torch.randn(x.shape).to(BF16)
        y, s = own("add_rms_norm")(x, r, w, 1e-6, 0.0, outside)
        torch.testing.assert_close(s, x + r, rtol=0, atol=0, equal_nan=True)  # eager's sum
        within_ulps(y, widened_rms(x + r, w, 1e-6, outside), 2)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_is_eagers_bfloat16_chain_bit_for_bit(interleaved):
    def rot(x):
        if interleaved:
            return torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], -1)

    cos, sin = (torch.randn(1, 1, 6, 16) * 2).to(BF16), (torch.randn(1, 1, 6, 16) * 2).to(BF16)
    for q in adversarial((2, 6, 4, 16)):
        q = q.transpose(1, 2)
        k = q[:, :2] * 0.5
        got = own("rotary")(q, k, cos, sin, -1, interleaved)
        for g, x in zip(got, (q, k)):
            e = x * cos + rot(x) * sin
            assert g.dtype is BF16 and g.stride() == e.stride()
            torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_within_one_ulp_of_eagers_bfloat16_ops(activation):
    act = F.silu if activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    for gate in adversarial((4, 6, 40)):
        up = torch.randn(gate.shape).to(BF16)
        got = own("gated")(gate, up, activation)
        assert got.dtype is BF16
        # The activation within its float32 bound (docs/numerics.md) before its rounding: one
        # bfloat16 ulp apart at most, then eager's product; where the float32 result itself has
        # only its absolute bound (GELU-tanh below about -4, SiLU's underflow below -87), that.
        torch.testing.assert_close(
            got.float(),
            (act(gate) * up).float(),
            rtol=2 * ULP,
            atol=2e-6 * up.abs().max(),
            equal_nan=True,
        )


def test_mixed_dtypes_take_eagers_chain():
    x = torch.randn(2, 8, 32)
    w = torch.randn(32).to(BF16)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, True) + 1e-6) * w
    torch.testing.assert_close(own("rms_norm")(x, w, 1e-6), expected, rtol=0, atol=0)


# --- through torch.compile ----------------------------------------------------------------------


class LlamaNorm(nn.Module):
    def __init__(self, n=64):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        v = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(v + 1e-6)).to(dtype)


class Block(nn.Module):
    """A Llama-style decoder layer's fused parts, in bfloat16 as a model casts to it."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = LlamaNorm(d), LlamaNorm(d)
        self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, 128, bias=False), nn.Linear(d, 128, bias=False)
        self.down = nn.Linear(128, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, s, self.heads, -1).transpose(1, 2)
        k = self.k(h).view(b, s, self.heads, -1).transpose(1, 2)

        def rot(t):
            half = t.shape[-1] // 2
            return torch.cat([-t[..., half:], t[..., :half]], -1)

        q = q * cos + rot(q) * sin
        k = k * cos + rot(k) * sin
        x = x + (q + k).transpose(1, 2).reshape(b, s, d)
        m = self.n2(x)
        return x + self.down(F.silu(self.gate(m)) * self.up(m))


def block_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, 64, generator=g).to(BF16)
    angles = torch.randn(1, 1, 8, 16, generator=g)
    return x, angles.cos().to(BF16), angles.sin().to(BF16)


def test_a_bfloat16_block_fuses_and_equals_eager(executor):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block().to(BF16).eval()
    options = {"cache": False, "pure_python": executor == "python"}
    with recording_compiles() as built, torch.no_grad():
        f = torch.compile(model, backend="fxrt", options=options)
        for seed in (1, 2):
            inputs = block_inputs(seed)
            got, want = f(*inputs), model(*inputs)
            assert got.dtype is BF16
            # a few bfloat16 ulps of the residual stream (each fused step within one)
            torch.testing.assert_close(got.float(), want.float(), rtol=4 * ULP, atol=4 * ULP)
    counts = fxrt.pattern_counts(built[-1])
    assert counts == {"rms_norm": 1, "add_rms_norm": 1, "rotary": 1, "gated_mlp": 1}, counts


class PureBfloat16Norm(nn.Module):
    """An RMSNorm written in bfloat16 throughout: every step rounds; not what the op computes."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_a_norm_rounding_each_step_keeps_its_ops(executor):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    options = {"cache": False, "pure_python": executor == "python"}
    with recording_compiles() as built, torch.no_grad():
        f = torch.compile(PureBfloat16Norm(), backend="fxrt", options=options)
        x = torch.randn(4, 64).to(BF16)
        torch.testing.assert_close(f(x), PureBfloat16Norm()(x), rtol=0, atol=0)
    assert fxrt.pattern_counts(built[-1]) == {}
