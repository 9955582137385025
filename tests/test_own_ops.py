"""fxrt's own CPU ops (fxrt/ops/own_ops.py, registered by fxrt/_speedups), on both loops.

``fxrt::gelu`` must give exactly what ATen's own GELU kernel gives (eager with oneDNN off) on
small float32 inputs, and exactly eager's result everywhere else; ``fxrt::layer_norm`` exactly
eager's result. Graphs that still need what the ATen op returns keep it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import LoggingDispatchMode, skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.ops import own_ops

pytestmark = [
    pytest.mark.skipif(
        not own_ops.available(), reason="fxrt's own ops come with the compiled extension"
    ),
    # torch.backends.mkldnn.flags() sets oneDNN's TF32 flag too, and warns that it has no effect.
    pytest.mark.filterwarnings("ignore:TF32 acceleration"),
]


def compiled(fn, inputs, executor, **options):
    skip_unless_executor(executor)
    gm = make_fx(fn)(*inputs)
    cfg = fxrt.CompilerConfig(pure_python=executor == "python", cache=False, **options)
    cg = fxrt.compile_graph(gm, list(inputs), cfg)
    assert cg.executor == executor
    return cg


def aten_kernel(fn, *inputs):
    """``fn`` in eager with oneDNN off: ATen's own CPU kernels."""
    with torch.backends.mkldnn.flags(enabled=False):
        return fn(*inputs)


def both_loops(fn, inputs, **options):
    """fn compiled on each loop, called on ``inputs``: the two results, which must be equal, and
    eager's up to GELU's documented rounding (bit for bit against ATen's own kernels)."""
    results = [compiled(fn, inputs, ex, **options)(*inputs) for ex in ("python", "cpp")]
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    torch.testing.assert_close(results[0], fn(*inputs))
    torch.testing.assert_close(results[0], aten_kernel(fn, *inputs), rtol=0, atol=0)
    return results[0]


def perturbed(*inputs):
    return tuple(x * 0.75 + 0.125 for x in inputs)


@pytest.mark.parametrize("shape", [(1, 256), (3, 5, 7), (8192,)])
def test_small_gelu_is_atens_own_kernel(executor, shape):
    x = torch.randn(shape) * 4
    cg = compiled(F.gelu, (x,), executor)
    assert "fxrt::gelu(" in str(cg.program) and "aten::gelu" not in str(cg.program)
    for inference in (False, True):  # the arena's gelu.out and the functional op
        with torch.inference_mode(inference):
            got = cg(x)
        torch.testing.assert_close(got, aten_kernel(F.gelu, x), rtol=0, atol=0)
        torch.testing.assert_close(got, F.gelu(x))  # eager (oneDNN) up to rounding


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.randn(8193), id="large"),
        pytest.param(lambda: torch.randn(16, 32).t(), id="non-contiguous"),
        pytest.param(lambda: torch.randn(64, dtype=torch.float64), id="float64"),
    ],
)
def test_gelu_outside_the_fast_path_is_eagers(executor, make):
    x = make()
    with torch.inference_mode():
        got = compiled(F.gelu, (x,), executor)(x)
    torch.testing.assert_close(got, F.gelu(x), rtol=0, atol=0)


def test_tanh_gelu_is_eagers(executor):
    x = torch.randn(64)
    fn = lambda x: F.gelu(x, approximate="tanh")  # noqa: E731
    got = compiled(fn, (x,), executor)(x)
    torch.testing.assert_close(got, fn(x), rtol=0, atol=0)


def test_loops_agree_bit_for_bit():
    x = torch.randn(4, 300)
    w, b = torch.randn(300), torch.randn(300)
    both_loops(lambda x, w, b: F.layer_norm(F.gelu(x), [300], w, b), (x, w, b))


def test_results_survive_the_next_call(executor):
    # The arena holds fxrt::gelu's and fxrt::layer_norm's results inside the graph; what the
    # caller receives must not change when the graph runs again on other values.
    x, w = torch.randn(4, 64), torch.randn(64)
    fn = lambda x, w: (F.layer_norm(F.gelu(x) * 2, [64], w), F.gelu(x + 1) + 1)  # noqa: E731
    cg = compiled(fn, (x, w), executor)
    assert "via fxrt::gelu.out" in str(cg.program)
    with torch.inference_mode():
        first = cg(x, w)
        kept = [t.clone() for t in first]
        second = cg(*perturbed(x, w))
    torch.testing.assert_close(list(first), kept, rtol=0, atol=0)
    torch.testing.assert_close(first, fn(x, w))
    torch.testing.assert_close(second, fn(*perturbed(x, w)))


def test_gelu_under_autograd(executor):
    x = torch.randn(2, 64, requires_grad=True)
    cg = compiled(F.gelu, (x.detach(),), executor)
    got = cg(x)
    assert got.requires_grad
    got.sum().backward()
    ref = x.detach().clone().requires_grad_()
    want = F.gelu(ref)
    want.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, ref.grad)


def test_a_dispatch_mode_sees_the_aten_ops(executor):
    x, w = torch.randn(2, 64), torch.randn(64)
    fn = lambda x, w: F.layer_norm(F.gelu(x), [64], w)  # noqa: E731
    cg = compiled(fn, (x, w), executor)
    with LoggingDispatchMode() as mode:
        got = cg(x, w)
    assert "aten.gelu.default" in mode.seen and "aten.native_layer_norm.default" in mode.seen
    torch.testing.assert_close(got, fn(x, w))


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_is_eagers(executor, affine):
    m = torch.nn.LayerNorm([4, 32], elementwise_affine=affine)
    if affine:
        torch.nn.init.normal_(m.weight)
        torch.nn.init.normal_(m.bias)
    x = torch.randn(3, 4, 32)
    with torch.no_grad():
        cg = compiled(m, (x,), executor)
        listing = str(cg.program)
        assert "fxrt::layer_norm(" in listing and "via fxrt::layer_norm.out" not in listing
        torch.testing.assert_close(cg(x), m(x), rtol=0, atol=0)
        # Inside a graph the result is an intermediate: the arena holds it.
        fn = lambda x: m(x) * 2  # noqa: E731
        cg = compiled(fn, (x,), executor)
        assert "via fxrt::layer_norm.out" in str(cg.program)
        torch.testing.assert_close(cg(x), fn(x), rtol=0, atol=0)


def test_layer_norm_keeps_the_statistics_a_graph_uses(executor):
    x = torch.randn(2, 16)
    fn = lambda x: torch.ops.aten.native_layer_norm.default(x, [16], None, None, 1e-5)  # noqa: E731
    cg = compiled(fn, (x,), executor)
    assert "aten::native_layer_norm(" in str(cg.program)
    torch.testing.assert_close(cg(x), fn(x), rtol=0, atol=0)


def test_own_ops_off_keeps_the_aten_ops(executor):
    x = torch.randn(2, 16)
    fn = lambda x: F.layer_norm(F.gelu(x), [16])  # noqa: E731
    cg = compiled(fn, (x,), executor, own_ops=False)
    listing = str(cg.program)
    assert "fxrt::" not in listing and "aten::gelu(" in listing
    torch.testing.assert_close(cg(x), fn(x), rtol=0, atol=0)


def test_old_option_and_variable_names_still_work(monkeypatch):
    """``native_kernels`` and ``FXRT_NATIVE_KERNELS`` are deprecated names of ``own_ops`` and
    ``FXRT_OWN_OPS``: they still work, with one DeprecationWarning each per process."""
    from fxrt import config

    monkeypatch.setattr(config, "_warned", set())
    monkeypatch.delenv("FXRT_OWN_OPS", raising=False)
    monkeypatch.setenv("FXRT_NATIVE_KERNELS", "0")
    with pytest.warns(DeprecationWarning, match="FXRT_NATIVE_KERNELS is deprecated"):
        assert not fxrt.CompilerConfig().own_ops
    monkeypatch.delenv("FXRT_NATIVE_KERNELS")
    with pytest.warns(DeprecationWarning, match="native_kernels is deprecated; use own_ops"):
        cfg = fxrt.CompilerConfig.from_options(None, {"native_kernels": False})
    assert not cfg.own_ops and not cfg.native_kernels
    assert not fxrt.CompilerConfig(native_kernels=False).own_ops
    assert "native_kernels" not in fxrt.CompilerConfig.option_names()


def test_out_overload_checks_its_output():
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="out has sizes"):
        torch.ops.fxrt.layer_norm.out(x, [16], None, None, 1e-5, out=torch.empty(3))


# --- fxrt::attention ---------------------------------------------------------------------------

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _sdpa_inputs(b, h, hk, lq, s, d, layout):
    """q, k, v with the layouts models hand attention: dense, or [B, L, H, D] seen through a
    transpose (a projection's output)."""
    if layout == "dense":
        return torch.randn(b, h, lq, d), torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    t = lambda *shape: torch.randn(shape[0], shape[2], shape[1], shape[3]).transpose(1, 2)  # noqa: E731
    return t(b, h, lq, d), t(b, hk, s, d), t(b, hk, s, d)


@pytest.mark.parametrize(
    "b, h, hk, lq, s, d",
    [
        (1, 4, 4, 16, 16, 16),
        (2, 4, 2, 7, 9, 8),
        (1, 8, 1, 1, 33, 20),
        (1, 2, 2, 40, 17, 64),
        (1, 8, 2, 1, 77, 64),  # a decoding step: rows' dot products, a group's heads as rows
        (2, 4, 2, 3, 50, 32),  # a few queries: rows' dot products, one head at a time
        (1, 4, 2, 130, 131, 16),  # a prompt: keys laid out in tiles
        (1, 2, 1, 1, 600, 128),
    ],
)
@pytest.mark.parametrize("layout", ["dense", "transposed"])
@pytest.mark.parametrize("causal, mask", [(False, None), (True, None), (False, "2d"), (True, "4d")])
def test_small_attention_is_eagers(executor, b, h, hk, lq, s, d, layout, causal, mask):
    q, k, v = _sdpa_inputs(b, h, hk, lq, s, d, layout)
    m = {None: None, "2d": torch.randn(lq, s), "4d": torch.randn(b, 1, lq, s)}[mask]
    scale = 0.3 if d == 20 else None

    def fn(q, k, v, m):
        return FLASH(q, k, v, 0.0, causal, attn_mask=m, scale=scale)

    cg = compiled(fn, (q, k, v, m), executor)
    assert "fxrt::attention(" in str(cg.program)
    for args in ((q, k, v, m), (*perturbed(q, k, v), m)):  # two calls, other values
        got, want = cg(*args), fn(*args)
        for g, w in zip(got, want):  # output and logsumexp: same layouts, values within rounding
            assert g.shape == w.shape and g.stride() == w.stride()
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize(
    "b, h, hk, lq, s, d", [(1, 4, 2, 16, 16, 16), (1, 8, 2, 1, 77, 64), (2, 4, 4, 40, 40, 32)]
)
@pytest.mark.parametrize("layout", ["dense", "transposed"])
def test_attention_whose_logsumexp_nobody_reads_is_sdpa_into_the_arena(
    executor, b, h, hk, lq, s, d, layout
):
    """Inference reads only the attention's output: fxrt::sdpa, the same kernel returning that
    alone, written into its arena slot through sdpa.out (laid out as eager's output)."""
    q, k, v = _sdpa_inputs(b, h, hk, lq, s, d, layout)

    def fn(q, k, v):
        return FLASH(q, k, v, 0.0, True)[0] * 2

    cg = compiled(fn, (q, k, v), executor)
    text = str(cg.program)
    assert "fxrt::sdpa(" in text and "via fxrt::sdpa.out" in text, text
    assert "fxrt::attention(" not in text
    for args in ((q, k, v), perturbed(q, k, v)):
        got, want = cg(*args), fn(*args)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want)
    # both loops, and the call without the arena, give the same bits
    other = compiled(fn, (q, k, v), "python" if executor == "cpp" else "cpp")
    assert torch.equal(other(q, k, v), cg(q, k, v))


def test_sdpa_out_takes_any_layout_and_names_a_wrong_size():
    q, k, v = _sdpa_inputs(1, 4, 2, 9, 9, 16, "dense")
    want = FLASH(q, k, v, 0.0, True)[0]
    out = torch.empty(1, 9, 4, 16).transpose(1, 2)  # [B, L, H, D] seen as [B, H, L, D]
    got = torch.ops.fxrt.sdpa.out(q, k, v, 0.0, True, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, want)
    # off the fast path (a row with no key left): ATen's values copied into out
    mask = torch.zeros(9, 9)
    mask[2] = float("-inf")
    out = torch.full((1, 4, 9, 16), 7.0)
    torch.ops.fxrt.sdpa.out(q, k, v, 0.0, False, attn_mask=mask, out=out)
    torch.testing.assert_close(out, FLASH(q, k, v, 0.0, False, attn_mask=mask)[0], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"fxrt::sdpa.out: out has sizes \[1, 4, 9, 8\]"):
        torch.ops.fxrt.sdpa.out(q, k, v, 0.0, True, out=torch.empty(1, 4, 9, 8))


def test_attention_outside_the_fast_path_is_eagers(executor):
    q, k, v = _sdpa_inputs(1, 2, 2, 4, 6, 8, "dense")
    mask = torch.zeros(4, 6)
    mask[1] = float("-inf")  # a row with no key: ATen defines it (zeros), the fast path leaves it

    def fn(q, k, v, m):
        return FLASH(q, k, v, 0.0, False, attn_mask=m)

    cg = compiled(fn, (q, k, v, mask), executor)
    for got, want in zip(cg(q, k, v, mask), fn(q, k, v, mask)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # above kSerialWork with more than kSerialThreads intra-op threads: ATen's kernel
    big = _sdpa_inputs(1, 4, 4, 128, 128, 64, "dense")
    cg = compiled(fn, (*big, None), executor)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for got, want in zip(cg(*big, None), fn(*big, None)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        torch.set_num_threads(threads)


def test_attention_under_autograd_is_atens(executor):
    q, k, v = (t.requires_grad_() for t in _sdpa_inputs(1, 2, 2, 5, 5, 8, "dense"))
    fn = lambda q, k, v: FLASH(q, k, v, 0.0, True)[0]  # noqa: E731
    cg = compiled(fn, tuple(t.detach() for t in (q, k, v)), executor)
    got = cg(q, k, v)
    got.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = fn(q, k, v)
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(grads, [t.grad for t in (q, k, v)])


# --- fxrt::tanh --------------------------------------------------------------------------------


def assert_within_ulps(got, want, ulps):
    """Equal NaN positions, and every other element at most ``ulps`` float32 steps from eager's
    (signed zeros, infinities and denormals included)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    steps = got[keep].view(torch.int32).long() - want[keep].view(torch.int32).long()
    assert steps.numel() == 0 or steps.abs().max().item() <= ulps


def special_values():
    x = torch.randn(64) * 30
    x[:12] = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -1e-40, 1e-45, 9.0,
         -9.0, 1e30, 4e-4]
    )  # fmt: skip
    return x


@pytest.mark.parametrize("shape", [(7,), (4, 33), (2, 4, 64, 64)])
def test_tanh_within_one_ulp_of_eager(executor, shape):
    """The bound docs/numerics.md states, through the call and the arena's out= form."""

    def fn(x):
        return torch.tanh(x), torch.tanh(x * 2.0) * 4.0  # an output; an intermediate (exact * 4)

    x = torch.randn(shape) * 3
    cg = compiled(fn, (x,), executor)
    listing = str(cg.program)
    assert "fxrt::tanh(" in listing and "via fxrt::tanh.out" in listing
    for args in (
        (x,),
        perturbed(x),
        (special_values().expand(*shape[:-1], 64)[..., : shape[-1]].contiguous(),),
    ):
        for got, want in zip(cg(*args), fn(*args)):
            assert_within_ulps(got, want, 1)


def test_tanh_loops_agree_bit_for_bit():
    x = torch.randn(3, 50) * 4
    got = [compiled(torch.tanh, (x,), ex)(x) for ex in ("python", "cpp")]
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)


def test_tanh_outside_the_fast_path_is_eagers(executor):
    """Strided input, autograd, and a large input with more than one intra-op thread: the ATen
    op itself."""
    x = torch.randn(8, 6)
    cg = compiled(lambda t: torch.tanh(t.t()), (x,), executor)
    torch.testing.assert_close(cg(x), torch.tanh(x.t()), rtol=0, atol=0)
    big = torch.randn(40000)
    cg = compiled(torch.tanh, (big,), executor)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.testing.assert_close(cg(big), torch.tanh(big), rtol=0, atol=0)
    finally:
        torch.set_num_threads(threads)
    w, w_eager = (torch.randn(5, generator=torch.Generator().manual_seed(3)) for _ in "ab")
    w.requires_grad_(), w_eager.requires_grad_()
    torch.ops.fxrt.tanh(w).sum().backward()
    torch.tanh(w_eager).sum().backward()
    torch.testing.assert_close(w.grad, w_eager.grad, rtol=0, atol=0)
