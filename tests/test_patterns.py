"""Fused patterns (fxrt.patterns): the math, in the spellings models write, becomes one fused call;
results stay eager's.

* fxrt's own ops against eager's chains, directly: random inputs, large magnitudes, denormals,
  zero rows, NaN and Inf (the bounds the docs state);
* hand-written blocks through ``torch.compile`` on both loops, each called twice with different
  values: how many fused calls each pattern made, and the outputs against eager;
* the guards: what must keep its ATen ops (another dtype, a norm over another dimension, an
  intermediate the caller receives) still equals eager;
* the registry: turning patterns off by name, a user's pattern, the cache key;
* the NPU targets, selected on the stand-in device under torch_npu's op names.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import native_available, recording_compiles, skip_unless_executor
from torch import nn

import fxrt
from fxrt.patterns import Made, Match, Target, View, registered_patterns

needs_ops = pytest.mark.skipif(not native_available(), reason="fxrt's own ops need the extension")
BF16_CPU = True  # eager computes these chains in bfloat16 on the CPU


def own(name: str):
    fxrt.runtime_info()  # loads the extension, which registers the ops
    return getattr(torch.ops.fxrt, name)


# --- the ops against eager's chains -------------------------------------------------------------


def rms_eager(x, w=None, eps=1e-6, offset=0.0, outside=False):
    ms = x.pow(2).mean(-1, keepdim=True)
    y = x / (ms.sqrt() + eps) if outside else x * torch.rsqrt(ms + eps)
    return y if w is None else y * (w + offset if offset else w)


FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def rotate_pairs(x):
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)


def adversarial(shape: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(shape, generator=g)
    big = base * 1e18
    tiny = base * 1e-39  # denormals
    zero = base.clone()
    zero[..., 0, :] = 0
    special = base.clone()
    special[..., 0, 0] = float("nan")
    special[..., 1, 1] = float("inf")
    special[..., 2, 2] = float("-inf")
    return [base, base * 30, big, tiny, zero, special]


@needs_ops
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("outside", [False, True])
@pytest.mark.parametrize("n", [64, 37, 5])  # whole lane blocks, a tail, a row shorter than one
def test_rms_norm_op_within_bound_of_eager(offset, outside, n):
    w = torch.randn(n) if n != 37 else None
    for x in adversarial((3, 5, n)):
        expected = rms_eager(x, w, 1e-6, offset, outside)
        got = own("rms_norm")(x, w, 1e-6, offset, outside)
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6, equal_nan=True)
        out = torch.empty_like(x)
        own("rms_norm").out(x, w, 1e-6, offset, outside, out=out)
        torch.testing.assert_close(out, got, rtol=0, atol=0, equal_nan=True)
        r = torch.randn_like(x)
        y, s = own("add_rms_norm")(x, r, w, 1e-6, offset, outside)
        torch.testing.assert_close(s, x + r, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(
            y, rms_eager(x + r, w, 1e-6, offset, outside), rtol=2e-6, atol=1e-6, equal_nan=True
        )


# Rows dense in memory though not contiguous (the last dimension stays innermost), as Gemma-3's
# per-head norms read q and k after their transpose; and layouts the fast path does not read.
PERMUTED = {
    "heads_transposed": lambda x: x.transpose(1, 2),
    "permuted": lambda x: x.permute(2, 0, 1, 3),
    "unit_dim_strides": lambda x: x[:1].transpose(1, 2),
}
NOT_DENSE = {
    "column_slice": lambda x: x[..., 1:],
    "last_dim_moved": lambda x: x.transpose(2, 3),
    "row_step": lambda x: x[:, ::2],
    "unit_dim_slice": lambda x: x[:, :1].transpose(1, 2),
}


@needs_ops
@pytest.mark.parametrize("layout", [*PERMUTED, *NOT_DENSE])
def test_rms_norm_op_on_strided_rows(layout):
    """fxrt::rms_norm of a permuted dense input keeps its strides, as eager's chain does; its
    out= form writes an out of those strides in place and any other out through a copy; layouts
    whose rows are not dense in memory (and add_rms_norm of a permuted input) take eager's chain."""
    view = {**PERMUTED, **NOT_DENSE}[layout]
    for base in adversarial((2, 6, 4, 16)):
        x = view(base)
        n = x.shape[-1]
        w = torch.randn(n)
        expected = rms_eager(x, w, 1e-6, 1.0)
        got = own("rms_norm")(x, w, 1e-6, 1.0, False)
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6, equal_nan=True)
        assert got.stride() == expected.stride()
        if layout in PERMUTED:
            assert got.stride() == x.stride()
        for out in (torch.empty_like(x), torch.empty(x.shape)):
            own("rms_norm").out(x, w, 1e-6, 1.0, False, out=out)
            torch.testing.assert_close(out, got, rtol=0, atol=0, equal_nan=True)
        r = torch.randn(x.shape)
        y, total = own("add_rms_norm")(x, r, w, 1e-6, 1.0, False)
        torch.testing.assert_close(total, x + r, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(
            y, rms_eager(x + r, w, 1e-6, 1.0), rtol=2e-6, atol=1e-6, equal_nan=True
        )


@needs_ops
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("features", [-1, 8])
def test_rotary_op_is_eagers_bit_for_bit(interleaved, features):
    rot = rotate_pairs if interleaved else rotate_half
    cos, sin = torch.randn(1, 1, 6, 16 if features == -1 else features).unbind(0) * 2
    cos, sin = cos[None], sin[None]
    for q in adversarial((2, 6, 4, 16)):
        q = q.transpose(1, 2)  # [B, H, L, D] as a view, as models make it
        k = q[:, :2] * 0.5
        expected = []
        for x in (q, k):
            if features == -1:
                expected.append(x * cos + rot(x) * sin)
            else:
                xr, xp = x[..., :features], x[..., features:]
                expected.append(torch.cat([xr * cos + rot(xr) * sin, xp], -1))
        got = own("rotary")(q, k, cos, sin, features, interleaved)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)
            assert g.stride() == e.stride()


@needs_ops
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_op_within_bound_of_eager(activation):
    act = F.silu if activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    for gate in adversarial((4, 6, 40)):
        up = torch.randn_like(gate)
        expected = act(gate) * up
        got = own("gated")(gate, up, activation)
        torch.testing.assert_close(got, expected, rtol=4e-6, atol=1e-6, equal_nan=True)
    wide = torch.randn(4, 80)
    gate, up = wide[:, :40], wide[:, 40:]  # halves of one tensor: rows 80 apart
    torch.testing.assert_close(
        own("gated")(gate, up, activation), act(gate) * up, rtol=4e-6, atol=1e-6
    )
    with pytest.raises(RuntimeError, match="activation must be 'silu' or 'gelu_tanh'"):
        own("gated")(gate, up, "relu")


@needs_ops
@pytest.mark.parametrize(
    "b, h, hk, lq, s, d, causal",
    [
        (1, 4, 2, 20, 20, 16, True),  # a prompt: keys in tiles
        (1, 4, 2, 20, 20, 16, False),
        (1, 8, 2, 1, 40, 64, False),  # a decoding step: a group's heads as the rows
        (2, 4, 2, 3, 50, 32, False),  # a few queries: rows' dot products
        (1, 4, 4, 1, 33, 20, False),  # features not a multiple of the vector width
    ],
)
@pytest.mark.parametrize("operand", ["q", "k", "v"])
def test_attention_op_within_bound_of_eager(b, h, hk, lq, s, d, causal, operand):
    """The bound docs/numerics.md states: 2e-6 of the largest value's magnitude (or of 1),
    NaN and Inf where eager has them."""
    g = torch.Generator().manual_seed(2)
    base = {
        "q": torch.randn(b, h, lq, d, generator=g),
        "k": torch.randn(b, hk, s, d, generator=g),
        "v": torch.randn(b, hk, s, d, generator=g),
    }
    shape = base[operand].shape
    variants = adversarial((*shape[:-2], max(shape[-2], 3), shape[-1]))
    for x in (x[..., : shape[-2], :] for x in variants):
        q, k, v = (x if name == operand else t for name, t in base.items())
        expected = FLASH(q, k, v, 0.0, causal)[0]
        got = own("attention")(q, k, v, 0.0, causal)[0]
        finite = v[v.isfinite()].abs().max().item()
        torch.testing.assert_close(
            got, expected, rtol=0, atol=2e-6 * max(finite, 1.0), equal_nan=True
        )


@needs_ops
def test_ops_follow_eager_off_the_fast_path():
    """float16, autograd, another layout: the reference path is eager's chain itself (bfloat16:
    tests/test_patterns_bf16.py)."""
    x = torch.randn(2, 8, 32, dtype=torch.float16)
    w = torch.randn(32, dtype=torch.float16)
    torch.testing.assert_close(own("rms_norm")(x, w, 1e-6), rms_eager(x, w), rtol=0, atol=0)
    g = torch.randn(8, 32, requires_grad=True)
    y = own("gated")(g, g.detach() * 2, "silu")
    y.sum().backward()
    expected = torch.autograd.grad((F.silu(g) * (g.detach() * 2)).sum(), g)[0]
    torch.testing.assert_close(g.grad, expected)


# --- hand-written blocks ------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, n: int = 32, spelling: str = "llama"):
        super().__init__()
        self.spelling = spelling
        self.weight = nn.Parameter(torch.randn(n) * 0.1 + (0 if spelling == "gemma" else 1))

    def forward(self, x):
        s = self.spelling
        if s == "llama":  # weight * (x * rsqrt(mean(x^2) + eps))
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        if s == "gemma":  # (x * rsqrt(...)) * (1 + weight)
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * (1.0 + self.weight)
        if s == "square":  # x * x, weight on the right
            return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * self.weight
        if s == "outside":  # eps outside the root
            return self.weight * (x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + 1e-6))
        if s == "plain":  # no weight
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        raise AssertionError(s)


class Residual(nn.Module):
    """Two residual adds, each followed by the next block's norm."""

    def __init__(self):
        super().__init__()
        self.n1, self.n2 = RMSNorm(), RMSNorm()
        self.f = nn.Linear(32, 32)

    def forward(self, x, y):
        h = x + y
        a = self.f(self.n1(h))
        h = h + a
        return self.n2(h), h


class Rope(nn.Module):
    def __init__(self, interleaved: bool = False, partial: int | None = None):
        super().__init__()
        self.interleaved, self.partial = interleaved, partial
        self.qk = nn.Linear(32, 48)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k = self.qk(x).split([32, 16], -1)
        q = q.view(b, s, 4, 8).transpose(1, 2)
        k = k.view(b, s, 2, 8).transpose(1, 2)
        rot = rotate_pairs if self.interleaved else rotate_half
        outs = []
        for t in (q, k):
            if self.partial is not None:
                r, p = t[..., : self.partial], t[..., self.partial :]
                outs.append(torch.cat([r * cos + rot(r) * sin, p], -1))
            else:
                outs.append(t * cos + rot(t) * sin)
        return F.scaled_dot_product_attention(
            outs[0], outs[1], outs[1], is_causal=True, enable_gqa=True
        )


class GatedMLP(nn.Module):
    def __init__(self, act: str = "silu"):
        super().__init__()
        self.act = act
        self.gate, self.up, self.down = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        g = self.gate(x)
        a = {
            "silu": lambda: F.silu(g),
            "sigmoid": lambda: g * torch.sigmoid(g),
            "gelu_tanh": lambda: F.gelu(g, approximate="tanh"),
            "gelu": lambda: F.gelu(g),  # exact GELU: not a target's
        }[self.act]()
        return self.down(a * self.up(x))


class RepeatKV(nn.Module):
    """Attention over K/V heads repeated with transformers' repeat_kv, with a mask (the case
    in which transformers repeats instead of passing enable_gqa); ``layout="bshd"``: Meta's
    repeat_kv, on [b, s, h, d] before the heads' transpose."""

    def __init__(self, layout: str = "bhsd"):
        super().__init__()
        self.qkv = nn.Linear(32, 64)
        self.layout = layout

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([32, 16, 16], -1)
        q = q.view(b, s, 4, 8).transpose(1, 2)
        if self.layout == "bshd":
            k, v = (t.view(b, s, 2, 8)[:, :, :, None].expand(b, s, 2, 2, 8) for t in (k, v))
            k, v = (t.reshape(b, s, 4, 8).transpose(1, 2) for t in (k, v))
        else:
            k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in (k, v))
            k, v = (t[:, :, None].expand(b, 2, 2, s, 8).reshape(b, 4, s, 8) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _cos_sin(s: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(1, 1, s, d, generator=g) * 6
    return angle.cos(), angle.sin()


def compile_twice(model, make_inputs, executor, programs=None, tol=1e-5, graphs=None, **options):
    """Compile ``model`` with fxrt on ``executor``, call it on two different inputs, compare each
    with eager (within ``tol``; 0: bit for bit); return the pattern counts of the graphs it built
    (their programs appended to ``programs``, the compiled graphs to ``graphs``, when given)."""
    skip_unless_executor(executor)
    torch._dynamo.reset()
    compiled = torch.compile(
        model, backend="fxrt", options={"pure_python": executor == "python", **options}
    )
    with recording_compiles() as built, torch.no_grad():
        for seed in (0, 1):
            inputs = make_inputs(seed)
            torch.testing.assert_close(
                compiled(*inputs), model(*inputs), rtol=tol, atol=tol, equal_nan=True
            )
    assert built and {cg.executor for cg in built} == {executor}
    if programs is not None:
        programs.extend(cg.program for cg in built)
    if graphs is not None:
        graphs.extend(built)
    counts: dict[str, int] = {}
    for cg in built:
        for k, v in fxrt.pattern_counts(cg).items():
            counts[k] = counts.get(k, 0) + v
    return counts


def x_input(*shape):
    return lambda seed: (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)),)


SPELLINGS = ["llama", "gemma", "square", "outside", "plain"]


@needs_ops
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_rms_norm_spellings_fuse(spelling, executor):
    counts = compile_twice(RMSNorm(spelling=spelling), x_input(2, 7, 32), executor)
    assert counts == {"rms_norm": 1}


class HeadNorms(nn.Module):
    """Gemma-3's attention input: q and k projected, split into heads, transposed, then each
    normalized per head (``(1 + w)``), the transposed layout kept."""

    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim // 2, bias=False)
        self.q_norm = RMSNorm(dim // heads, spelling="gemma")
        self.k_norm = RMSNorm(dim // heads, spelling="gemma")

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, 16).transpose(1, 2)
        k = self.k(x).view(b, s, -1, 16).transpose(1, 2)
        return self.q_norm(q), self.k_norm(k)


@needs_ops
def test_norms_of_transposed_heads_fuse(executor):
    model = HeadNorms()
    assert compile_twice(model, x_input(2, 7, 64), executor) == {"rms_norm": 2}
    compiled = torch.compile(model, backend="fxrt", options={"pure_python": executor == "python"})
    x = x_input(2, 7, 64)(2)[0]
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert [t.stride() for t in got] == [t.stride() for t in want]
    assert not got[0].is_contiguous()


@needs_ops
def test_norms_of_transposed_heads_fuse_with_dynamic_shapes(executor):
    """Symbolic sizes: the transposed layout's strides are expressions, still dense rows."""
    skip_unless_executor(executor)
    torch._dynamo.reset()
    model = HeadNorms()
    compiled = torch.compile(
        model, backend="fxrt", dynamic=True, options={"pure_python": executor == "python"}
    )
    with recording_compiles() as built, torch.no_grad():
        for seed, (b, s) in enumerate([(2, 5), (3, 9), (2, 13)]):
            x = x_input(b, s, 64)(seed)[0]
            got, want = compiled(x), model(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert [t.stride() for t in got] == [t.stride() for t in want]
    assert len(built) == 1 and fxrt.pattern_counts(built[0]) == {"rms_norm": 2}


@needs_ops
def test_residual_adds_fuse_with_their_norms(executor):
    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)

    assert compile_twice(Residual(), inputs, executor) == {"add_rms_norm": 2}


@needs_ops
@pytest.mark.parametrize("form", ["half", "interleaved", "partial", "partial_all"])
def test_rotary_q_and_k_in_one_call(form, executor):
    """partial_all: Phi-3's partial rotary code with every feature rotated (an empty rest)."""
    partial = {"partial": 4, "partial_all": 8}.get(form)
    model = Rope(interleaved=form == "interleaved", partial=partial)
    d = partial or 8

    def inputs(seed):
        return (torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(seed)),
                *_cos_sin(6, d, seed))  # fmt: skip

    assert compile_twice(model, inputs, executor) == {"rotary": 1}


class ChainedRope(nn.Module):
    """Two rotations over one cos and sin, the second of a value made from the first's result:
    no one call stands for both, so each is its own."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(32, 32)

    def forward(self, x, cos, sin):
        b, n, _ = x.shape
        q = self.w(x).view(b, n, 4, 8).transpose(1, 2)
        q1 = q * cos + rotate_half(q) * sin
        y = q1 * 2 + 1
        return q1, y * cos + rotate_half(y) * sin


@needs_ops
def test_chained_rotations_fuse_one_by_one(executor):
    def inputs(seed):
        return (torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(seed)),
                *_cos_sin(6, 8, seed))  # fmt: skip

    assert compile_twice(ChainedRope(), inputs, executor) == {"rotary": 2}


@needs_ops
@pytest.mark.parametrize("act", ["silu", "sigmoid", "gelu_tanh"])
def test_gated_mlp_fuses(act, executor):
    assert compile_twice(GatedMLP(act), x_input(3, 32), executor) == {"gated_mlp": 1}


@needs_ops
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_repeated_kv_heads_are_read_unrepeated(layout, executor):
    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        mask = torch.randn(1, 1, 6, 6, generator=g)
        return torch.randn(2, 6, 32, generator=g), mask

    counts = compile_twice(RepeatKV(layout), inputs, executor)
    assert counts == {"gqa_attention": 1}


# --- guards -------------------------------------------------------------------------------------


def test_exact_gelu_and_other_dtypes_keep_their_ops(executor):
    assert compile_twice(GatedMLP("gelu"), x_input(3, 32), executor) == {}
    bf16 = RMSNorm().to(torch.bfloat16)
    counts = compile_twice(bf16, lambda s: (x_input(2, 7, 32)(s)[0].bfloat16(),), executor)
    assert counts == {}


class NormOverRows(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + 1e-6)


class NormAlsoReturnsRoot(nn.Module):
    def forward(self, x):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * r, r


def test_what_is_not_the_pattern_keeps_its_ops(executor):
    assert compile_twice(NormOverRows(), x_input(2, 7, 32), executor) == {}
    assert compile_twice(NormAlsoReturnsRoot(), x_input(2, 7, 32), executor) == {}


# --- the registry -------------------------------------------------------------------------------


@needs_ops
def test_disable_patterns_by_name(executor):
    model = Residual()

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 32, generator=g)

    counts = compile_twice(model, inputs, executor, disable_patterns=["add_rms_norm"])
    assert counts == {"rms_norm": 2}
    counts = compile_twice(model, inputs, executor, disable_patterns=["add_rms_norm", "rms_norm"])
    assert counts == {}


def test_unknown_pattern_name_is_an_error():
    with pytest.raises(ValueError, match="unknown pattern.*'rmsnorm'.*registered patterns: "):
        fxrt.CompilerConfig(disable_patterns=["rmsnorm"])
    with pytest.raises(ValueError, match="must be a list of pattern names"):
        fxrt.CompilerConfig(disable_patterns="rotary")


class Softplus(nn.Module):
    def forward(self, x):
        return torch.log1p(torch.exp(x)) * 2


def match_softplus(node, index):
    exp = index.only_for(node.args[0], "aten::exp")
    if exp is None:
        return None
    return Match((exp.args[0],), {}, [node.outputs[0]], [node, exp])


def test_a_users_pattern(executor, tmp_path):
    fxrt.register_pattern(
        "softplus", match_softplus, {"cpu": Target(torch.ops.aten.softplus.default)},
        anchors=["aten::log1p"],
    )  # fmt: skip
    try:
        with pytest.raises(ValueError, match="registered already"):
            fxrt.register_pattern(
                "softplus", match_softplus, {"cpu": torch.ops.aten.softplus.default},
                anchors=["aten::log1p"],
            )  # fmt: skip
        counts = compile_twice(Softplus(), x_input(4, 9), executor, cache_dir=str(tmp_path))
        assert counts == {"softplus": 1}
        counts = compile_twice(
            Softplus(), x_input(4, 9), executor, cache_dir=str(tmp_path),
            disable_patterns=["softplus"],
        )  # fmt: skip
        assert counts == {}
    finally:
        fxrt.unregister_pattern("softplus")
    assert "softplus" not in registered_patterns()
    # a cache entry made with the pattern is not what a compile without it may read
    assert compile_twice(Softplus(), x_input(4, 9), executor, cache_dir=str(tmp_path)) == {}


def _softplus_of_a_view(op):
    def match(node, index):
        exp = index.only_for(node.args[0], "aten::exp")
        if exp is None:
            return None
        view = View(op, (exp.args[0],), index.meta(exp.args[0]))  # the fused call reads a view
        return Match((view,), {}, [node.outputs[0]], [node, exp])

    return match


def test_a_view_argument_is_made_before_the_call(executor):
    fxrt.register_pattern(
        "softplus_view", _softplus_of_a_view(torch.ops.aten.alias.default),
        {"cpu": Target(torch.ops.aten.softplus.default)}, anchors=["aten::log1p"],
    )  # fmt: skip
    try:
        assert compile_twice(Softplus(), x_input(4, 9), executor) == {"softplus_view": 1}
    finally:
        fxrt.unregister_pattern("softplus_view")


def test_a_view_argument_that_computes_is_refused(executor):
    fxrt.register_pattern(
        "softplus_view", _softplus_of_a_view(torch.ops.aten.exp.default),
        {"cpu": Target(torch.ops.aten.softplus.default)}, anchors=["aten::log1p"],
    )  # fmt: skip
    try:
        with pytest.raises(Exception, match="'softplus_view' at node 'log1p'.*not a view op"):
            compile_twice(Softplus(), x_input(4, 9), executor)
    finally:
        fxrt.unregister_pattern("softplus_view")


def _scaled_softplus(match, _index):
    """softplus reads its input doubled and halved: a target whose op takes the value in
    another form than the graph holds it (made before the call)."""
    (x,) = match.args
    doubled = Made(torch.ops.aten.mul.Scalar, (x, 2.0))
    return Match((Made(torch.ops.aten.mul.Scalar, (doubled, 0.5)),), {}, match.results, match.nodes)


def test_a_made_argument_is_computed_before_the_call(executor):
    fxrt.register_pattern(
        "softplus_made", match_softplus,
        {"cpu": Target(torch.ops.aten.softplus.default, adapt=_scaled_softplus)},
        anchors=["aten::log1p"],
    )  # fmt: skip
    try:
        with recording_compiles() as built:
            assert compile_twice(Softplus(), x_input(4, 9), executor) == {"softplus_made": 1}
        ops = [(n.name, n.op.name) for n in built[0].graph.nodes]
        made = [name for name, op in ops if op == "aten::mul.Scalar"]
        assert made == ["softplus_made_made", "softplus_made_made_1"], ops
        assert [op for _, op in ops][-2:] == ["aten::softplus", "aten::mul.Tensor"], ops
        # a dynamic shape: a Made without its meta cannot be worked out, and says so
        torch._dynamo.reset()
        compiled = torch.compile(Softplus(), backend="fxrt", dynamic=True,
                                 options={"pure_python": executor == "python"})  # fmt: skip
        with pytest.raises(Exception, match="'softplus_made'.*needs static tensor arguments"):
            compiled(torch.randn(4, 9))
    finally:
        fxrt.unregister_pattern("softplus_made")


def test_builtins_are_registered_in_order():
    assert list(registered_patterns())[:8] == [
        "layer_norm", "add_rms_norm", "rms_norm", "rotary", "rotary_complex", "gated_mlp",
        "gqa_attention", "gqa_softcap_attention",
    ]  # fmt: skip
    assert list(registered_patterns())[:8] == list(fxrt.patterns.BUILTIN)


@needs_ops
def test_own_ops_off_keeps_the_aten_ops(executor):
    assert compile_twice(RMSNorm(), x_input(2, 7, 32), executor, own_ops=False) == {}


class ZeroDim(nn.Module):
    """Products and sums with 0-d tensors on either side: the anchors' operands have no last
    dimension (a matcher must not index one)."""

    def forward(self, x):
        s = torch.tensor(2.0)
        y = s * x + 1
        z = x.sum() * torch.rsqrt(x.pow(2).mean() + 1e-6)
        return y * s, z + s, torch.sigmoid(s) * s


def test_zero_dim_operands_are_not_a_pattern(executor):
    assert compile_twice(ZeroDim(), x_input(5), executor) == {}


class Block(nn.Module):
    """A small decoder block: norm, rotary q/k, attention, residual norm, gated MLP."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(), RMSNorm()
        self.rope = Rope()
        self.out = nn.Linear(32, 32)
        self.mlp = GatedMLP()

    def forward(self, x, cos, sin):
        a = self.rope(self.norm1(x), cos, sin)  # [B, 4, L, 8]
        h = x + self.out(a.transpose(1, 2).reshape(x.shape))
        return h + self.mlp(self.norm2(h))


def _block_inputs(seed):
    return (torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(seed)),
            *_cos_sin(6, 8, seed))  # fmt: skip


BLOCK = {"rms_norm": 1, "add_rms_norm": 1, "rotary": 1, "gated_mlp": 1}


@needs_ops
@pytest.mark.parametrize(
    "options",
    [{}, {"streams": "auto"}, {"mode": "reduce-overhead"}, {"capture": True, "arena": False}],
    ids=["default", "streams_auto", "reduce_overhead", "capture_no_arena"],
)
def test_fused_block_on_every_path(options, executor):
    mode = options.pop("mode", None)
    if mode is not None:
        options["capture"] = True  # what reduce-overhead turns on (the CPU runs the loop)
    assert compile_twice(Block(), _block_inputs, executor, **options) == BLOCK


class Chain(nn.Module):
    def forward(self, x):
        b = torch.cos(torch.exp(x))
        return torch.sin(b), b * 2


def match_chain(node, index):
    """sin(cos(exp(x))) claimed whole, though cos's result is read elsewhere too (made_by, not
    only_for): the pass must keep cos and the exp it reads."""
    cos = index.made_by(node.args[0], "aten::cos")
    exp = cos and index.made_by(cos.args[0], "aten::exp")
    if not exp:
        return None
    return Match((exp.args[0],), {}, [node.outputs[0]], [node, cos, exp])


def _sin_cos_exp(x):
    return torch.sin(torch.cos(torch.exp(x)))


_LIB: list[torch.library.Library] = []


def test_matched_nodes_read_elsewhere_stay(executor):
    if not _LIB:
        _LIB.append(torch.library.Library("fxrt_test_patterns", "FRAGMENT"))
        _LIB[0].define("sin_cos_exp(Tensor x) -> Tensor")
        _LIB[0].impl("sin_cos_exp", _sin_cos_exp, "CompositeImplicitAutograd")
    fxrt.register_pattern(
        "sin_cos_exp", match_chain,
        {"cpu": torch.ops.fxrt_test_patterns.sin_cos_exp.default}, anchors=["aten::sin"],
    )  # fmt: skip
    try:
        assert compile_twice(Chain(), x_input(6), executor) == {"sin_cos_exp": 1}
    finally:
        fxrt.unregister_pattern("sin_cos_exp")
