"""The ``rotary_complex`` pattern (fxrt/patterns/rotary_complex.py, fxrt::rotary_complex): the
rotary embedding written as a complex product (Meta's Llama) or multiplied out on real pairs
(gpt-fast) becomes one call for q and k.

* the op against the real-pair chain bit for bit, and against eager's complex multiply within
  the bound docs/numerics.md states, on random and adversarial inputs, float32 and bfloat16;
* both spellings through ``torch.compile`` on both loops, in float32 and bfloat16: one fused
  call, eager's values; the chains that must keep their ops (an intermediate the caller
  receives, frequencies of another dtype) still equal eager;
* Meta's reference Llama end to end (tests/reference_llama.py): its pattern counts and logits
  on both loops (its attention by hand, and with scaled_dot_product_attention), and cold then
  warm in two processes on one cache.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import native_available, recording_compiles, run_child, skip_unless_executor
from reference_llama import Llama, apply_rotary_emb, apply_rotary_pairs, tokens
from test_patterns import adversarial

import fxrt

pytestmark = pytest.mark.skipif(
    not native_available(), reason="fxrt's own ops need the compiled extension"
)
BF16 = torch.bfloat16
BOUND = 2.0**-22  # two float32 ulps at 1.0


def own():
    fxrt.runtime_info()  # loads the extension, which registers the op
    return torch.ops.fxrt.rotary_complex


def freqs(s: int, half: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.polar(torch.ones(s, half), torch.rand(s, half, generator=g) * 30)


def real_pairs(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """The product on real pairs, as ATen ops round it (x widened like x.float())."""
    fr = torch.view_as_real(f) if f.is_complex() else f
    xp = x.float().unflatten(-1, (-1, 2))
    a, b, c, s = xp[..., 0], xp[..., 1], fr[..., 0], fr[..., 1]
    return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2).to(x.dtype)


def eager_complex(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * f).flatten(-2).to(x.dtype)


def within_product_bound(got: torch.Tensor, expected: torch.Tensor, x, f) -> None:
    """Non-finite values where eager has them; finite ones within 2**-22 * max(|x0|, |x1|) *
    max(|c|, |s|) (two float32 ulps of the largest product: eager's complex multiply fuses one
    product into the difference in some of its loops)."""
    fr = torch.view_as_real(f).abs().amax(-1, keepdim=True)
    xp = x.unflatten(-1, (-1, 2)).abs().amax(-1, keepdim=True)
    scale = (xp * fr).expand(*xp.shape[:-1], 2).flatten(-2)
    finite = expected.isfinite()
    assert torch.equal(got.isfinite(), finite)
    torch.testing.assert_close(got[~finite], expected[~finite], equal_nan=True)
    assert ((got - expected).abs()[finite] <= BOUND * scale[finite] + 1e-45).all()


@pytest.mark.parametrize("half", [3, 8, 33])
def test_op_is_the_real_pair_product_bit_for_bit(half):
    f = freqs(5, half).view(1, 5, 1, half)
    for x in adversarial((2, 5, 4, 2 * half)):
        k = x[:, :, :2] * 0.5
        q_out, k_out = own()(x, k, f)
        assert q_out.is_contiguous() and q_out.shape == x.shape
        torch.testing.assert_close(q_out, real_pairs(x, f), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(k_out, real_pairs(k, f), rtol=0, atol=0, equal_nan=True)
        within_product_bound(q_out, eager_complex(x, f), x, f)
        # real (cos, sin) pairs give the same; so does a strided x (its heads transposed)
        q_real, _ = own()(x, x, torch.view_as_real(f))
        torch.testing.assert_close(q_real, q_out, rtol=0, atol=0, equal_nan=True)
        xt = x.transpose(1, 2).contiguous().transpose(1, 2)
        torch.testing.assert_close(own()(xt, xt, f)[0], q_out, rtol=0, atol=0, equal_nan=True)


def test_op_in_bfloat16_is_the_widened_chain():
    """bfloat16 q and k: computed from x.float(), rounded once to bfloat16, as the models' casts
    around the product do."""
    f = freqs(6, 8).view(1, 6, 1, 8)
    for x in adversarial((2, 6, 4, 16)):
        xb = x.to(BF16)
        got, _ = own()(xb, xb, f)
        assert got.dtype is BF16
        torch.testing.assert_close(got, real_pairs(xb, f), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(
            got.float(), eager_complex(xb, f).float(), rtol=2.0**-7, atol=1e-30, equal_nan=True
        )


def test_op_reference_path_takes_what_the_fast_path_does_not():
    """Frequencies in float64 or pairs not side by side run as ATen ops, with the same values."""
    f = freqs(5, 8).view(1, 5, 1, 8)
    x = torch.randn(2, 5, 3, 16)
    apart = torch.view_as_real(f).transpose(-1, -2).contiguous().transpose(-1, -2)
    want = real_pairs(x, f)
    torch.testing.assert_close(own()(x, x, apart)[0], want, rtol=0, atol=0)
    f64 = torch.view_as_real(f).double()
    torch.testing.assert_close(own()(x, x, f64)[0], real_pairs(x.double(), f64).float())
    with pytest.raises(RuntimeError, match="even number of features"):
        own()(torch.randn(2, 5, 3, 15), x, f)


# --- the spellings through torch.compile ---------------------------------------------------------


class Rope(torch.nn.Module):
    """q and k of a projection, rotated in one of the two spellings; returns both."""

    def __init__(self, form: str, expose: bool = False, freq_dtype=torch.float32):
        super().__init__()
        self.form, self.expose = form, expose
        self.wq, self.wk = torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)
        f = freqs(16, 4)
        self.freqs = f if form == "complex" else torch.view_as_real(f).to(freq_dtype)

    def forward(self, x):
        b, n, _ = x.shape
        q, k = self.wq(x).view(b, n, 4, 8), self.wk(x).view(b, n, 2, 8)
        f = self.freqs[:n]
        if not self.expose:
            if self.form == "complex":
                q2, k2 = apply_rotary_emb(q, k, f)
            else:
                q2, k2 = apply_rotary_pairs(q, f), apply_rotary_pairs(k, f)
            return q2.transpose(1, 2), k2
        # the caller also receives the product of q's chain; k's chain is the usual one
        if self.form == "complex":
            z = torch.view_as_complex(q.reshape(b, n, 4, 4, 2)) * f.view(1, n, 1, -1)
            return torch.view_as_real(z).flatten(3), apply_rotary_emb(k, k, f)[1], z
        fr, qs = f.view(1, n, 1, 4, 2), q.reshape(b, n, 4, 4, 2)
        re = qs[..., 0] * fr[..., 0] - qs[..., 1] * fr[..., 1]
        im = qs[..., 1] * fr[..., 0] + qs[..., 0] * fr[..., 1]
        z = torch.stack([re, im], -1)
        return z.flatten(3), apply_rotary_pairs(k, f), z


def compile_twice(model, dtype, executor, *, dynamic=False, lengths=(6, 6)):
    """fxrt-compiled ``model`` on two different inputs against eager; the pattern counts. The
    pairs spelling is eager's bit for bit; the complex one within the product bound (about a
    float32 ulp here), and a bfloat16 ulp where that moves a rounding."""
    skip_unless_executor(executor)
    tol = dict(rtol=0, atol=0)
    if model.form == "complex":
        tol = dict(rtol=1e-6, atol=1e-6) if dtype is torch.float32 else dict(rtol=2**-7, atol=0)
    torch._dynamo.reset()
    model = model.to(dtype)
    compiled = torch.compile(
        model, backend="fxrt", dynamic=dynamic, options={"pure_python": executor == "python"}
    )
    with recording_compiles() as built, torch.no_grad():
        for seed, n in enumerate(lengths):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(2, n, 32, generator=g).to(dtype)
            for got, want in zip(compiled(x), model(x)):
                torch.testing.assert_close(got, want, equal_nan=True, **tol)
    assert built and {cg.executor for cg in built} == {executor}
    counts: dict[str, int] = {}
    for cg in built:
        for k, v in fxrt.pattern_counts(cg).items():
            counts[k] = counts.get(k, 0) + v
    return counts, built


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("form", ["complex", "pairs"])
def test_both_spellings_are_one_call_for_q_and_k(form, dtype, executor):
    counts, _ = compile_twice(Rope(form), dtype, executor)
    assert counts == {"rotary_complex": 1}


@pytest.mark.parametrize("form", ["complex", "pairs"])
def test_a_chain_whose_product_is_returned_keeps_its_ops(form, executor):
    """The caller also receives q's product: q's chain keeps its ATen ops, k's alone fuses."""
    counts, built = compile_twice(Rope(form, expose=True), torch.float32, executor)
    assert counts == {"rotary_complex": 1}
    (fused,) = [n for n in built[0].graph.nodes if n.name.startswith("fused_")]
    assert fused.args[0] == fused.args[1]  # k alone


class Chained(torch.nn.Module):
    """Two rotations over one table, the second of a value made from the first's result: no
    single call can stand for both, so each chain is its own call."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(32, 32)
        self.freqs, self.form = freqs(16, 4), "complex"

    def forward(self, x):
        b, n, _ = x.shape
        f = self.freqs[:n]
        q = self.w(x).view(b, n, 4, 8)
        q1 = apply_rotary_emb(q, q, f)[0]
        q2 = apply_rotary_emb(q1 * 2 + 1, q1, f)[0]
        return q1, q2


def test_chains_one_call_cannot_stand_for_fuse_one_by_one(executor):
    counts, _ = compile_twice(Chained(), torch.float32, executor)
    assert counts == {"rotary_complex": 2}


def test_bfloat16_frequencies_keep_the_aten_ops(executor):
    """gpt-fast keeps its cache in the model's dtype: bfloat16 (cos, sin) times float32 pairs
    is not the op's float32 product, so the chain stays, with eager's values."""
    counts, _ = compile_twice(Rope("pairs", freq_dtype=BF16), BF16, executor)
    assert counts == {}


def test_one_dynamic_compile_for_many_lengths(executor):
    counts, built = compile_twice(Rope("complex"), torch.float32, executor, dynamic=True,
                                  lengths=(5, 9, 14))  # fmt: skip
    assert len(built) == 1 and counts == {"rotary_complex": 1}


# --- Meta's Llama --------------------------------------------------------------------------------

# Meta's attention by hand becomes the attention op (fuse_attention, its added causal mask
# is_causal), which then reads the K/V heads its repeat_kv copied un-repeated (gqa_attention)
LLAMA = {"rms_norm": 1, "add_rms_norm": 4, "rotary_complex": 2, "gated_mlp": 2, "gqa_attention": 2}


@pytest.mark.parametrize(
    "rope, attention", [("complex", "manual"), ("pairs", "manual"), ("complex", "sdpa")]
)
def test_reference_llama_fuses_and_equals_eager(rope, attention, executor):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(rope=rope, attention=attention).eval()
    compiled = torch.compile(model, backend="fxrt", options={"pure_python": executor == "python"})
    with recording_compiles() as built, torch.no_grad():
        for seed in (0, 1):
            t = tokens(2, 12, seed)
            torch.testing.assert_close(compiled(t), model(t), rtol=1e-5, atol=1e-5)
    assert [fxrt.pattern_counts(cg) for cg in built] == [LLAMA]


WARM = """
import json, sys, torch, fxrt
from conftest import recording_compiles
from reference_llama import Llama, tokens

torch.manual_seed(0)
model = Llama().eval().to(getattr(torch, sys.argv[1]))
compiled = torch.compile(model, backend="fxrt")
tol = 1e-5 if sys.argv[1] == "float32" else 3e-2
with recording_compiles() as built, torch.no_grad():
    for seed in (0, 1):
        t = tokens(2, 10, seed)
        torch.testing.assert_close(compiled(t), model(t), rtol=tol, atol=tol)
print(json.dumps({"counts": [fxrt.pattern_counts(cg) for cg in built],
                  "stats": dict(fxrt.cache.stats)}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_llama_cold_then_warm(executor, dtype, tmp_path):
    """A cold process, then a warm one on the same cache directory: the hit has the miss's
    fused calls, and both give eager's logits."""
    skip_unless_executor(executor)
    env = {"PYTHONPATH": os.path.dirname(__file__)}
    cold = run_child(WARM, tmp_path, executor, dtype, env=env)
    warm = run_child(WARM, tmp_path, executor, dtype, env=env)
    assert cold["stats"].get("hit", 0) == 0 and warm["stats"].get("hit", 0) >= 1, (cold, warm)
    # in bfloat16 the attention keeps its ops (fxrt's attention op computes float32)
    want = LLAMA if dtype == "float32" else {k: v for k, v in LLAMA.items() if k != "gqa_attention"}
    assert cold["counts"] == warm["counts"] == [want], (cold, warm)
