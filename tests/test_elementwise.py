"""OUT's inline elementwise form (fxrt.exec.elementwise, fxrt/_speedups/elementwise.h): the
listing says which OUTs have it, and every result is eager's bit for bit (signs of zeros and NaN
positions included) on both loops: adversarial values, full, row (bias) and number operands,
lengths with and without a vector tail, and calls whose tensors the form does not handle."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import run_child, skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt import cache
from fxrt.exec.elementwise import MAX_ELEMENTS


def compiled(fn, inputs, executor, **options):
    skip_unless_executor(executor)
    config = fxrt.CompilerConfig(pure_python=executor == "python", **options)
    return fxrt.compile_graph(make_fx(fn)(*inputs), inputs, config)


def bitwise_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    mask = ~want.isnan()
    assert torch.equal(got[mask], want[mask]), (got - want).abs().max()


def adversarial(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random values with zeros of both signs, NaN, infinities, denormals and huge values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3
    flat = x.view(-1)
    specials = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-42, -1e-42, 3e38, -3e38]
    picks = torch.randint(0, flat.numel(), (min(flat.numel(), 3 * len(specials)),), generator=g)
    for k, i in enumerate(picks.tolist()):
        flat[i] = specials[k % len(specials)]
    return x


def chain(x, y, b):
    """Every form: full, row (bias) and number operands, in both orders."""
    s = x + y
    d = x - b  # a row second
    e = b - x  # a row first
    p = s * d
    q = torch.relu(e) * 0.1  # clamp_min, then a number that float rounds
    r = (p + 2.5) - 1e-45  # numbers: one that rounds to a denormal
    return torch.relu(r * q) + x * y, b * x - torch.relu(y)


@pytest.mark.parametrize("cols", [16, 19])  # without and with a tail after the vector lanes
def test_results_are_eagers_bits(executor, cols):
    x, y, b = adversarial(5, cols, seed=1), adversarial(5, cols, seed=2), adversarial(cols, seed=3)
    cg = compiled(chain, (x, y, b), executor)
    listing = str(cg.program)
    for form in ("add", "sub", "mul", "clamp_min"):
        assert f"(inline {form})" in listing, listing
    for seed in (4, 5):  # new inputs, same shapes
        inputs = (adversarial(5, cols, seed=seed), adversarial(5, cols, seed=seed + 10), b)
        for got, want in zip(cg(list(inputs)), chain(*inputs)):
            bitwise_equal(got, want)


def test_what_has_no_form_keeps_the_out_call():
    """Only float32 CPU tensors up to MAX_ELEMENTS, alpha 1, and operands a row or whole."""

    def fn(x, i, big, col):
        return (  # each an intermediate, so that it is written into the arena
            torch.add(x, x, alpha=2).sum(),  # alpha
            (i + i).sum(),  # int64
            (big + 1.0).sum(),  # too many elements
            (x + col).sum(),  # a column operand: broadcasts other than per row
            ((x + 1) * 2).sum(),  # these two do
        )

    x, i, col = torch.randn(4, 8), torch.arange(32).view(4, 8), torch.randn(4, 1)
    big = torch.randn(MAX_ELEMENTS + 1)
    cg = compiled(fn, (x, i, big, col), "python")
    inline = [ins for ins in cg.program.code if getattr(ins, "elementwise", "")]
    assert [ins.elementwise for ins in inline] == ["add", "mul"], str(cg.program)
    assert str(cg.program).count(" OUT ") >= 6, str(cg.program)  # the others are OUTs too
    off = compiled(fn, (x, i, big, col), "python", own_ops=False)
    assert "(inline" not in str(off.program).replace("(inline)", "")


def test_tensors_the_form_does_not_handle_run_the_out_call(executor):
    """The form is checked on every call: a non-contiguous input (input checks off, so the call
    reaches the loop) runs the out= op, with eager's values."""

    def fn(x, y):
        return (x + y) * 3.0

    x, y = torch.randn(8, 8), torch.randn(8, 8)
    cg = compiled(fn, (x, y), executor, check_inputs=False)
    assert "(inline add)" in str(cg.program)
    for a in (torch.randn(8, 8).t(), torch.randn(8, 16)[:, ::2], torch.randn(8, 8)):
        bitwise_equal(cg([a, y]), fn(a, y))


def test_through_torch_compile_and_a_warm_cache(executor, tmp_path):
    torch._dynamo.reset()
    skip_unless_executor(executor)
    options = {"pure_python": executor == "python", "cache_dir": str(tmp_path)}

    def fn(x, b):
        return torch.relu(x * 0.5 + b) - x

    for attempt in range(2):  # the second compile is a cache hit
        torch._dynamo.reset()
        hits = cache.stats.get("hit", 0)
        f = torch.compile(fn, backend="fxrt", options=options)
        for seed in range(3):
            x, b = adversarial(3, 40, seed=seed), adversarial(40, seed=seed + 7)
            bitwise_equal(f(x, b), fn(x, b))
        assert cache.stats.get("hit", 0) == hits + attempt


def test_a_warm_second_process_runs_the_forms_of_its_cache_hit(executor, tmp_path):
    """A cold process and then a warm one on the same cache directory: the hit's program has the
    same inline forms as the miss's, and both give eager's bits on new inputs."""
    skip_unless_executor(executor)
    script = """
        import json, torch, fxrt
        from conftest import recording_compiles
        from test_elementwise import adversarial, bitwise_equal

        def fn(x, b):
            return torch.sin(torch.relu(x * 0.5 + b) - x)

        f = torch.compile(fn, backend="fxrt")
        with recording_compiles() as built:
            for seed in range(3):
                x, b = adversarial(3, 40, seed=seed), adversarial(40, seed=seed + 7)
                bitwise_equal(f(x, b), fn(x, b))
        forms = [i.elementwise for i in built[0].program.code if getattr(i, "elementwise", "")]
        print(json.dumps({"forms": forms, "stats": dict(fxrt.cache.stats)}))
    """
    env = {"PYTHONPATH": os.path.dirname(__file__)}
    cold = run_child(script, tmp_path, executor, env=env)
    warm = run_child(script, tmp_path, executor, env=env)
    assert cold["stats"].get("hit", 0) == 0 and warm["stats"].get("hit", 0) >= 1, (cold, warm)
    assert warm["forms"] == cold["forms"] == ["mul", "add", "clamp_min", "sub"], (cold, warm)


def test_the_compiled_loop_writes_them_without_the_dispatcher(executor):
    """Under torch.profiler, which records every op the dispatcher runs: the compiled loop's
    inline adds and muls call no aten::add or aten::mul (sin still does); the Python loop's do."""

    def fn(x):
        return torch.sin((x + 1.0) * 0.5)  # the result is not in the arena: not the add

    x = torch.randn(4, 16)
    cg = compiled(fn, (x,), executor)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = cg([x])
    bitwise_equal(got, fn(x))
    names = [e.name for e in prof.events()]
    assert "aten::sin" in names, names
    inline = {"aten::add", "aten::mul"} & set(names)
    assert inline == (set() if executor == "cpp" else {"aten::add", "aten::mul"}), names


def test_bound_under_aot_autograds_fake_mode(executor, tmp_path):
    """AOTAutograd calls fxrt under its fake mode; binding a number operand of an inline form
    read it through item(), which the fake mode refused, and the compile failed. In a fresh
    process: what this test session has run before hid the failure."""
    skip_unless_executor(executor)
    result = run_child(
        """
        import json, torch, fxrt
        from torch._dynamo.backends.common import aot_autograd
        from conftest import recording_compiles
        from test_elementwise import adversarial, bitwise_equal

        def fn(x):
            return torch.sin(torch.relu(x * 0.5 + 1.0))

        backend = aot_autograd(fw_compiler=fxrt.get_compiler(), keep_inference_input_mutations=True)
        f = torch.compile(fn, backend=backend)
        with recording_compiles() as built, torch.inference_mode():
            for seed in range(2):
                x = adversarial(4, 24, seed=seed)
                bitwise_equal(f(x), fn(x))
        print(json.dumps({"listing": str(built[0].program), "executor": built[0].executor}))
        """,
        tmp_path,
        executor,
        env={"PYTHONPATH": os.path.dirname(__file__)},
    )
    assert result["executor"] == executor
    listing = result["listing"]
    assert "(inline add)" in listing and "PYCALL" not in listing, listing
