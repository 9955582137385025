"""LayerNorm written out in ATen ops (fxrt/patterns/layer_norm.py, fxrt::layer_norm_chain in
fxrt/_speedups/own_layer_norm_chain.h): the op is eager's chain bit for bit (its means sum in
ATen's order, for each CPU capability ATen can run), the spellings models write fuse, and the
fused graphs equal eager on both loops, warm, and over dynamic shapes."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import native_available, recording_compiles, run_child, skip_unless_executor
from test_patterns import adversarial, compile_twice
from torch import nn

import fxrt

pytestmark = pytest.mark.skipif(
    not native_available(), reason="fxrt's own ops need the compiled extension"
)
BF16 = torch.bfloat16


def op():
    fxrt.runtime_info()  # loads the extension, which registers the ops
    return torch.ops.fxrt.layer_norm_chain


def chain(x, w=None, b=None, eps=1e-5, root="rsqrt"):
    """Eager's chain as models write it, the root spelled as ``root`` names it (bfloat16: on
    x.float(), the result cast back)."""
    dtype = x.dtype
    if dtype is BF16:
        x, w, b = (None if t is None else t.float() for t in (x, w, b))
    d = x - x.mean(-1, keepdim=True)
    v = d.pow(2).mean(-1, keepdim=True)
    y = {
        "rsqrt": lambda: d * torch.rsqrt(v + eps),
        "sqrt": lambda: d / torch.sqrt(v + eps),
        "sqrt_reciprocal": lambda: d * torch.reciprocal(torch.sqrt(v + eps)),
        "sqrt_eps": lambda: d / (v.sqrt() + eps),
        "sqrt_eps_reciprocal": lambda: d * torch.reciprocal(v.sqrt() + eps),
    }[root]()
    y = y if w is None else w * y
    y = y if b is None else y + b
    return y.to(dtype)


def same(got, expected):
    """Bit for bit (NaN where eager's is NaN)."""
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


# n: every residue of the vector widths (8, 16) and the ILP of 4 around them, ATen's cascade
# levels (16 vectors a level, more past 2^16 vectors), rows shorter than a vector
SIZES = [*range(1, 70), 100, 127, 128, 129, 255, 256, 257, 300, 512, 1000, 1024, 4096, 5000]
FORMS = ["rsqrt", "sqrt", "sqrt_reciprocal", "sqrt_eps", "sqrt_eps_reciprocal"]


@pytest.mark.parametrize("root", FORMS)
def test_the_op_is_eagers_chain_bit_for_bit(root):
    g = torch.Generator().manual_seed(0)
    for n in SIZES:
        x = torch.randn(3, n, generator=g) * 3 + 0.5
        w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
        for args in [(None, None), (w, None), (None, b), (w, b)]:
            same(op()(x, *args, 1e-5, root), chain(x, *args, 1e-5, root))


@pytest.mark.parametrize("root", FORMS)
def test_many_rows_bit_for_bit(root):
    """The sqrt forms take their roots from aten::sqrt over every row at once (MKL's vector
    sqrt is not always correctly rounded): any number of rows, aligned or not."""
    g = torch.Generator().manual_seed(7)
    for r in (1, 2, 7, 15, 16, 17, 33, 100, 2049, 5000):
        x = torch.randn(r, 24, generator=g) * 4
        same(op()(x, None, None, 1e-5, root), chain(x, None, None, 1e-5, root))


def test_an_unknown_root_is_named():
    with pytest.raises(RuntimeError, match="root must be 'rsqrt'.*got 'cbrt'"):
        op()(torch.randn(2, 8), None, None, 1e-5, "cbrt")


@pytest.mark.parametrize("n", [40000, 70000, 262160])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_long_rows_bit_for_bit(rows, n):
    """Rows past ATen's first cascade levels; one long row on several threads is ATen's
    two-pass reduction, which the op leaves to eager's chain."""
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n)) + 1e3
    same(op()(x, None, None, 1e-5), chain(x))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        same(op()(x, None, None, 1e-5), chain(x))
    finally:
        torch.set_num_threads(threads)


def test_adversarial_inputs_bit_for_bit():
    """Large magnitudes, a 1e4 offset (the mean nearly cancels each element), denormals, zero
    rows, NaN and +-inf (propagated as eager propagates them), -0."""
    cases = adversarial((3, 5, 64))
    base = cases[0]
    cases += [base + 1e4, base * 0 - 0.0, base[..., :37] * 1e-42, (base * 1e30).exp()]
    w = torch.randn(base.shape[-1])
    for x in cases:
        wx = w[: x.shape[-1]]
        for eps in (1e-5, 0.0):
            for root in FORMS:
                args = (wx, None, eps, root)
                same(op()(x, *args), chain(x, *args))


CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import test_layer_norm_chain as t

torch.set_num_threads(1)
g = torch.Generator().manual_seed(3)
bad = []
for n in t.SIZES + [40000]:
    x = torch.randn(2, n, generator=g) * 5 - 1
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    for root in t.FORMS:
        if not torch.equal(t.op()(x, w, b, 1e-6, root), t.chain(x, w, b, 1e-6, root)):
            bad.append([n, root])
print(json.dumps({"bad": bad, "capability": torch.backends.cpu.get_cpu_capability()}))
"""


@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2", "AVX512"])
def test_each_cpu_capability_in_atens_order(capability, tmp_path):
    """The op sums in the order ATen's mean runs at each capability (ATEN_CPU_CAPABILITY, or the
    CPU's best): vectors of 8 floats, or 16 where a build's AVX512 mean has them (torch 2.13's
    AVX512 mean keeps 8)."""
    levels = ["DEFAULT", "AVX2", "AVX512"]
    best = torch.backends.cpu.get_cpu_capability()
    if best not in levels or levels.index(capability) > levels.index(best):
        pytest.skip(f"this CPU runs ATen at {best} at best, not {capability}")
    out = run_child(
        CHILD, tmp_path, "native", os.path.dirname(__file__),
        env={"ATEN_CPU_CAPABILITY": capability.lower()},
    )  # fmt: skip
    assert out["capability"] == capability
    assert out["bad"] == []


def test_the_fast_path_runs_here():
    """The op finds ATen's summation order on this CPU and takes its own path: eager's chain
    (the reference path) would show up as aten::mean calls in a profile."""
    x = torch.randn(4, 6, 48)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = op()(x, None, None, 1e-5, "rsqrt")
    names = {e.name for e in prof.events()}
    assert "fxrt::layer_norm_chain" in names and "aten::mean" not in names, names
    same(got, chain(x, None, None, 1e-5, "rsqrt"))


def test_bfloat16_is_the_widened_chain_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    for n in (8, 37, 64, 256, 1000):
        w, b = (torch.randn(n, generator=g).to(BF16) for _ in range(2))
        for x in [c.to(BF16) for c in adversarial((3, 5, n))]:
            for root in FORMS:
                got = op()(x, w, b, 1e-5, root)
                assert got.dtype is BF16
                same(got, chain(x, w, b, 1e-5, root))


def test_the_out_form_and_the_reference_path():
    x = torch.randn(4, 6, 48)
    w, b = torch.randn(48), torch.randn(48)
    out = torch.empty_like(x)
    assert op().out(x, w, b, 1e-5, out=out) is out
    same(out, chain(x, w, b))
    # off the fast path (a transposed input, a float64 input, a strided out): eager's chain
    xt = x.transpose(0, 1)
    same(op()(xt, w, b, 1e-5), chain(xt, w, b))
    x64 = x.double()
    same(op()(x64, w.double(), None, 1e-5), chain(x64, w.double()))
    strided = torch.empty(4, 6, 96)[..., ::2]
    op().out(x, w, b, 1e-5, out=strided)
    same(strided, chain(x, w, b))
    with pytest.raises(RuntimeError, match="out has sizes"):
        op().out(x, w, b, 1e-5, out=torch.empty(4, 6, 47))


# --- the spellings models write -----------------------------------------------------------------


class CohereNorm(nn.Module):
    """transformers' CohereLayerNorm: no bias, the chain widened to float32."""

    def __init__(self, n=64, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        mean = x.mean(-1, keepdim=True)
        variance = (x - mean).pow(2).mean(-1, keepdim=True)
        x = (x - mean) * torch.rsqrt(variance + self.eps)
        return (self.weight.to(torch.float32) * x).to(dtype)


class WrittenNorm(nn.Module):
    """The other spellings: one ``x - u`` node, ``/ sqrt``, ``d * d``, eps outside, a bias."""

    def __init__(self, spelling, n=64, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.bias = nn.Parameter(torch.randn(n))
        self.spelling, self.eps = spelling, eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        if self.spelling == "convnext":  # (x - u) / sqrt(s + eps), weight * x + bias
            s = (x - u).pow(2).mean(-1, keepdim=True)
            return self.weight * ((x - u) / torch.sqrt(s + self.eps)) + self.bias
        d = x - u
        if self.spelling == "square":
            s = (d * d).mean(-1, keepdim=True)
            return d * torch.rsqrt(s + self.eps) * self.weight
        if self.spelling == "outside":
            s = d.pow(2).mean(-1, keepdim=True)
            return d / (s.sqrt() + self.eps) + self.bias
        s = d.pow(2).mean(-1, keepdim=True)  # "plain": no weight, no bias
        return d * torch.rsqrt(s + self.eps)


def compile_and_compare(model, make_inputs, executor, **options):
    """fxrt on ``executor`` against eager, bit for bit, on two different inputs: the pattern
    counts and the compiled graphs."""
    built: list[fxrt.CompiledGraph] = []
    counts = compile_twice(model, make_inputs, executor, tol=0, graphs=built, **options)
    return counts, built


def rows(*shape, dtype=torch.float32):
    def make(seed):
        g = torch.Generator().manual_seed(seed)
        return ((torch.randn(*shape, generator=g) * 2 + seed).to(dtype),)

    return make


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["float32", "bfloat16"])
def test_cohere_norm_fuses(dtype, executor):
    model = CohereNorm().to(dtype)
    counts, built = compile_and_compare(model, rows(2, 7, 64, dtype=dtype), executor)
    assert counts == {"layer_norm": 1}
    ops = [n.op.name for cg in built for n in cg.graph.nodes]
    assert "fxrt::layer_norm_chain" in ops and "aten::mean.dim" not in ops
    if dtype is BF16:  # the casts are in the fused op
        assert "aten::_to_copy" not in ops


def test_a_float32_weight_on_a_bfloat16_input(executor):
    """The chain widens x but its weight is float32 already: the float32 chain fuses, the casts
    around it stay."""
    counts, built = compile_and_compare(CohereNorm(), rows(2, 7, 64, dtype=BF16), executor)
    assert counts == {"layer_norm": 1}
    ops = [n.op.name for cg in built for n in cg.graph.nodes]
    assert ops.count("aten::_to_copy") == 2


@pytest.mark.parametrize("spelling", ["convnext", "square", "outside", "plain"])
def test_written_spellings_fuse(spelling, executor):
    counts, _ = compile_and_compare(WrittenNorm(spelling), rows(3, 5, 64), executor)
    assert counts == {"layer_norm": 1}


@pytest.mark.parametrize(
    "options",
    [{"streams": "auto"}, {"capture": True, "arena": False}, {"arena": False}],
    ids=["streams_auto", "capture", "no_arena"],
)
def test_other_paths(options, executor):
    """Multi-stream planning, whole-graph capture and the functional op without the arena."""
    counts, _ = compile_and_compare(CohereNorm(), rows(2, 7, 64), executor, **options)
    assert counts == {"layer_norm": 1}


def test_a_chain_rounding_each_step_to_bfloat16_keeps_its_ops(executor):
    """eager's bfloat16 ops round every step; the fused op would not."""
    counts, _ = compile_and_compare(WrittenNorm("convnext").to(BF16), rows(3, 5, 64, dtype=BF16),
                                    executor)  # fmt: skip
    assert counts == {}


class Leaky(nn.Module):
    """The centered value is returned too: the chain's intermediates are not its own."""

    def forward(self, x):
        d = x - x.mean(-1, keepdim=True)
        return d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5), d


def test_an_intermediate_read_elsewhere_is_not_fused(executor):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    model = Leaky()
    compiled = torch.compile(model, backend="fxrt", options={"pure_python": executor == "python"})
    x = torch.randn(4, 32)
    with recording_compiles() as built, torch.no_grad():
        got = compiled(x)
    for g, e in zip(got, model(x)):  # the norm of d is an RMS norm's (within its bound)
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    assert fxrt.pattern_counts(built[0]) == {"rms_norm": 1}


def test_dynamic_shapes_one_compile(executor):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    model = CohereNorm()
    compiled = torch.compile(
        model, backend="fxrt", dynamic=True, options={"pure_python": executor == "python"}
    )
    with recording_compiles() as built, torch.no_grad():
        for s in (3, 9, 17):
            x = torch.randn(2, s, 64)
            same(compiled(x), model(x))
    assert len(built) == 1 and fxrt.pattern_counts(built[0]) == {"layer_norm": 1}


WARM = """
import json, sys, torch, fxrt
from conftest import recording_compiles
from test_layer_norm_chain import CohereNorm

torch.manual_seed(0)
model = CohereNorm()
compiled = torch.compile(model, backend="fxrt")
same = []
with recording_compiles() as built, torch.no_grad():
    for seed in (0, 1):
        x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(seed)) + seed
        same.append(torch.equal(compiled(x), model(x)))
print(json.dumps({"same": same, "counts": [fxrt.pattern_counts(cg) for cg in built],
                  "stats": dict(fxrt.cache.stats)}))
"""


def test_cold_then_warm(executor, tmp_path):
    """A second process on the same cache hits, runs the fused op, and gives eager's answers."""
    skip_unless_executor(executor)
    env = {"PYTHONPATH": os.path.dirname(__file__)}
    cold = run_child(WARM, tmp_path, executor, env=env)
    warm = run_child(WARM, tmp_path, executor, env=env)
    assert cold["stats"].get("hit", 0) == 0 and warm["stats"].get("hit", 0) >= 1, (cold, warm)
    assert cold["same"] == warm["same"] == [True, True]
    assert cold["counts"] == warm["counts"] == [{"layer_norm": 1}], (cold, warm)


def test_the_builtin_is_named_and_can_be_turned_off(executor):
    counts, built = compile_and_compare(
        WrittenNorm("convnext"), rows(3, 5, 64), executor, disable_patterns=["layer_norm"]
    )
    assert counts == {}
    assert "aten::mean.dim" in {n.op.name for cg in built for n in cg.graph.nodes}
