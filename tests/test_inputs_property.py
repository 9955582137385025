"""Generated inputs for ``CompiledGraph`` calls: eager's answer, or an error naming the input.

A few small graphs (element-wise, a reduction, a reshape that is a view or a copy depending on
strides, outputs that are the inputs or views of them, an in-place write to one input between two
reads of another) are traced with ``make_fx`` on plain contiguous example tensors and compiled for
static shapes on both loops. Hypothesis then calls them with generated inputs: random dtypes, ranks
0-3, sizes 0-3 (zero-size dims, 0-dim tensors), layouts (contiguous, transposed, sliced with a
step, at a storage offset, expanded with stride 0) and aliasing between inputs (two rows of one
base, the same tensor twice, two views of the same memory).

The rule each call must follow, from the README's contract: if every tensor input has the compiled
dtype, device and sizes, and the compiled stride in every dimension of size above 1, the results,
their aliasing with the inputs and the inputs' contents afterwards (in-place writes) are eager's on
copies of the same inputs (same aliasing); if eager raises on them, fxrt raises the same type.
Otherwise the call raises ``fxrt.InputError`` naming the first input that differs, with its
compiled and actual signatures. A symbolic-size trace of the same graphs must give eager's answer
or an ``InputError`` on every input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import native_available
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt

LOOPS = ["python", "cpp"] if native_available() else ["python"]
DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32]
LAYOUTS = ["contiguous", "transposed", "stepped", "offset", "expanded"]


# --- the graphs -------------------------------------------------------------------------------


def elementwise(x, y):
    return x * 2 + 1, y - x.sum()


def reduce_and_reshape(x, y):
    # reshape is a view of a contiguous input and a copy of a transposed one
    return x.sum(0) if x.dim() else x.sum(), y.reshape(-1) * 3


def outputs_alias_inputs(x, y):
    return x, torch.ops.aten.alias.default(y), x * 1


def write_between_reads(x, y):
    # With x and y views of one memory, b sees the write and a does not: no pass may merge the
    # two reads (CSE would, were inputs never aliased: neither product is an output).
    a = y * 2
    x.add_(1)
    b = y * 2
    return (a - b,)


GRAPHS: dict[str, Callable[..., Any]] = {
    f.__name__: f for f in (elementwise, reduce_and_reshape, outputs_alias_inputs)
}
SAME_SHAPE_GRAPHS: dict[str, Callable[..., Any]] = {"write_between_reads": write_between_reads}


# --- generated tensors ------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    dtype: torch.dtype
    shape: tuple[int, ...]


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-5, 6, shape, generator=g, dtype=dtype)


def make_tensor(spec: Spec, layout: str, seed: int) -> torch.Tensor:
    """A tensor of ``spec``'s dtype and shape whose strides and offset follow ``layout``."""
    shape, dtype = spec.shape, spec.dtype
    if layout == "transposed" and len(shape) >= 2:
        return _values(shape[::-1], dtype, seed).permute(*reversed(range(len(shape))))
    if layout == "stepped" and len(shape) >= 1:
        wide = (*shape[:-1], 2 * shape[-1])
        return _values(wide, dtype, seed)[..., ::2]
    if layout == "offset":
        n = 1
        for s in shape:
            n *= s
        return _values((n + 3,), dtype, seed)[3:].view(shape)
    if layout == "expanded" and len(shape) >= 1:
        ones = tuple(1 for _ in shape)
        return _values(ones, dtype, seed).expand(shape)
    return _values(shape, dtype, seed)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def accepted(spec: Spec, x: torch.Tensor) -> bool:
    """What a static graph traced on a contiguous ``spec`` tensor accepts: the dtype, the sizes,
    and the strides of the dimensions of size above 1."""
    if x.dtype != spec.dtype or tuple(x.shape) != spec.shape:
        return False
    want = contiguous_strides(spec.shape)
    return all(st == w for sz, st, w in zip(x.shape, x.stride(), want) if sz > 1)


shapes = st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple)
specs = st.builds(Spec, st.sampled_from(DTYPES), shapes)


@st.composite
def call_inputs(
    draw, traced: list[Spec], same_shape: bool, layouts: list[str]
) -> tuple[list[torch.Tensor], str]:
    """Inputs for a graph traced on ``traced``: mostly the traced dtypes and shapes in random
    layouts, sometimes another dtype or shape, sometimes two inputs sharing memory."""
    inputs, what = [], []
    for i, spec in enumerate(traced):
        kind = draw(st.sampled_from(["same"] * 4 + ["dtype", "shape"]))
        if kind == "dtype":
            spec = Spec(draw(st.sampled_from(DTYPES)), spec.shape)
        elif kind == "shape":
            spec = Spec(spec.dtype, draw(shapes))
        layout = draw(st.sampled_from(layouts))
        inputs.append(make_tensor(spec, layout, seed=i + 1))
        what.append(f"{kind}/{layout}")
    sharing = draw(st.sampled_from(["none", "none", "rows", "same object", "same memory"]))
    x = inputs[0]
    if sharing != "none" and (same_shape or traced[0] == traced[1]):
        if sharing == "rows":
            base = torch.stack([x.contiguous(), x.contiguous() + 1])
            inputs[:2] = [base[0], base[1]]
        elif sharing == "same object":
            inputs[1] = x
        else:
            inputs[1] = x.view(x.shape)
        what.append(f"sharing {sharing}")
    return inputs, ", ".join(what)


def copy_preserving_aliases(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies with the same sizes, strides, offsets and shared storages (object identity too)."""
    storages: dict[int, torch.UntypedStorage] = {}
    made: dict[int, torch.Tensor] = {}
    out = []
    for t in tensors:
        if id(t) in made:
            out.append(made[id(t)])
            continue
        s = t.untyped_storage()
        key = s.data_ptr() if s.nbytes() else -id(t)
        if key not in storages:
            storages[key] = s.clone()
        c = torch.empty(0, dtype=t.dtype).set_(
            storages[key], t.storage_offset(), t.shape, t.stride()
        )
        made[id(t)] = c
        out.append(c)
    return out


# --- checks -----------------------------------------------------------------------------------


def _storage(x: Any) -> int | None:
    if isinstance(x, torch.Tensor) and x.untyped_storage().nbytes():
        return x.untyped_storage().data_ptr()
    return None


def aliasing(outputs: tuple, inputs: list) -> list:
    ins = [_storage(x) for x in inputs]
    return [[j for j, s in enumerate(ins) if s is not None and s == _storage(o)] for o in outputs]


def call(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> tuple[Any, Any]:
    """(result, None) or (None, the exception)."""
    try:
        return fn(*inputs), None
    except Exception as e:  # compared with what the other side raised
        return None, e


def check_call(
    cg: fxrt.CompiledGraph, fn: Callable, traced: list[Spec] | None, inputs: list[torch.Tensor]
) -> None:
    eager_inputs = copy_preserving_aliases(inputs)
    fxrt_inputs = copy_preserving_aliases(inputs)
    want, eager_error = call(fn, eager_inputs)
    got, error = call(cg, fxrt_inputs)
    if traced is not None:  # static: the rule is known exactly
        bad = [i for i, (s, x) in enumerate(zip(traced, inputs, strict=True)) if not accepted(s, x)]
        if bad:
            assert isinstance(error, fxrt.InputError), (
                f"expected InputError naming {bad[0]}, got {error!r}"
            )
            assert f"input {bad[0]} " in str(error), str(error)
            assert "compiled for" in str(error) and "got" in str(error), str(error)
            return
    elif isinstance(error, fxrt.InputError):  # symbolic: any input the trace specialized on
        assert str(error).startswith("input ") or "input " in str(error), str(error)
        return
    if eager_error is not None:
        assert error is not None, f"eager raised {eager_error!r}, fxrt returned {got!r}"
        assert isinstance(error, type(eager_error)), (error, eager_error)
        return
    if error is not None:
        raise AssertionError(f"fxrt raised where eager did not: {error!r}") from error
    assert isinstance(got, tuple) and len(got) == len(want), (got, want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert aliasing(got, fxrt_inputs) == aliasing(want, eager_inputs)
    for a, b in zip(fxrt_inputs, eager_inputs, strict=True):  # in-place writes reached the caller
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def compile_for(fn: Callable, examples: list[torch.Tensor], loop: str, mode: str):
    gm = make_fx(fn, tracing_mode=mode)(*copy_preserving_aliases(examples))
    cg = fxrt.compile_graph(
        gm, None, fxrt.CompilerConfig(pure_python=loop == "python", cache=False)
    )
    assert cg.executor == loop
    return cg


THIS_MANY = settings(
    max_examples=max(30, settings().max_examples // 6),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@st.composite
def cases(draw, layouts: list[str] = LAYOUTS) -> tuple[str, list[Spec], list[torch.Tensor], str]:
    name = draw(st.sampled_from(sorted(GRAPHS) + sorted(SAME_SHAPE_GRAPHS)))
    if name in SAME_SHAPE_GRAPHS:
        spec = draw(specs)
        traced = [spec, spec]
    else:
        traced = [draw(specs), draw(specs)]
    inputs, what = draw(call_inputs(traced, name in SAME_SHAPE_GRAPHS, layouts))
    return name, traced, inputs, what


def _function(name: str) -> Callable[..., Any]:
    return {**GRAPHS, **SAME_SHAPE_GRAPHS}[name]


@pytest.mark.parametrize("loop", LOOPS)
@THIS_MANY
@given(case=cases())
def test_static_graph_gives_eagers_answer_or_names_the_input(loop: str, case) -> None:
    name, traced, inputs, what = case
    note(f"{name} traced on {traced}; called with {what}: {[describe(x) for x in inputs]}")
    examples = [make_tensor(s, "contiguous", seed=10 + i) for i, s in enumerate(traced)]
    fn = _function(name)
    _, example_error = call(fn, copy_preserving_aliases(examples))
    assume(example_error is None)  # nothing to trace
    cg = compile_for(fn, examples, loop, "real")
    check_call(cg, fn, traced, inputs)
    # The graph still works after a refused or odd call, on inputs like its examples.
    check_call(
        cg, fn, traced, [make_tensor(s, "offset", seed=20 + i) for i, s in enumerate(traced)]
    )


# Symbolic graphs are traced on contiguous examples, so they are compiled for dense inputs (the
# check compares the layout the strides imply, see test_symbolic_graph_names_...); called with
# every layout, each call gives eager's answer or an InputError.


@pytest.mark.parametrize("loop", LOOPS)
@settings(THIS_MANY, max_examples=max(20, settings().max_examples // 12))
@given(case=cases())
def test_symbolic_graph_gives_eagers_answer_or_an_input_error(loop: str, case) -> None:
    name, traced, inputs, what = case
    note(f"{name} traced symbolically on {traced}; called with {what}")
    examples = [make_tensor(s, "contiguous", seed=10 + i) for i, s in enumerate(traced)]
    fn = _function(name)
    _, example_error = call(fn, copy_preserving_aliases(examples))
    assume(example_error is None)
    try:
        cg = compile_for(fn, examples, loop, "symbolic")
    except (RuntimeError, NotImplementedError) as e:  # a guard make_fx cannot keep symbolic
        note(f"no symbolic trace: {e}")
        assume(False)
    check_call(cg, fn, None, inputs)


def describe(x: torch.Tensor) -> str:
    dt = str(x.dtype).removeprefix("torch.")
    return f"{dt}{list(x.shape)} stride {x.stride()} offset {x.storage_offset()}"


def test_wrong_shapes_on_a_static_matmul_name_the_input(executor: str) -> None:
    # The first hour: a static graph called with other shapes fails with the input's name, not
    # deep inside an op.
    if executor == "cpp" and not native_available():
        pytest.skip("the compiled loop is not built")
    w = torch.randn(8, 4)
    gm = make_fx(lambda x, w: torch.relu(x @ w))(torch.randn(2, 8), w)
    cfg = fxrt.CompilerConfig(pure_python=executor == "python", cache=False)
    cg = fxrt.compile_graph(gm, None, cfg)
    with pytest.raises(fxrt.InputError, match=r"input 0 'x_1': compiled for float32\[2, 8\]"):
        cg(torch.randn(3, 8), w)
    with pytest.raises(fxrt.InputError, match=r"input 1 'w_1': compiled for float32\[8, 4\]"):
        cg(torch.randn(2, 8), torch.randn(8, 5))


def test_symbolic_graph_names_an_input_whose_strides_it_relied_on(executor: str) -> None:
    """A symbolic-size graph traced on a contiguous input (a reshape became a view) is compiled
    for dense inputs: a transposed one is named, not failed inside aten::view; a contiguous one
    of another size, and a size-1 dimension with any stride, pass."""
    if executor == "cpp" and not native_available():
        pytest.skip("the compiled loop is not built")
    gm = make_fx(lambda y: y.reshape(-1) * 3, tracing_mode="symbolic")(torch.randn(2, 3))
    cfg = fxrt.CompilerConfig(pure_python=executor == "python", cache=False)
    cg = fxrt.compile_graph(gm, None, cfg)
    with pytest.raises(fxrt.InputError, match="input 0.*not dense in the layout"):
        cg(torch.randn(3, 2).t())
    for y in (torch.randn(4, 5), torch.randn(5, 1).as_strided((5, 1), (1, 7))):
        torch.testing.assert_close(cg(y), y.reshape(-1) * 3)
    # Permuted dense: traced channels-last stays channels-last.
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    gm = make_fx(lambda x: x.flatten(2).sum(-1), tracing_mode="symbolic")(x)
    cg = fxrt.compile_graph(gm, None, cfg)
    y = torch.randn(3, 3, 2, 6).to(memory_format=torch.channels_last)
    torch.testing.assert_close(cg(y), y.flatten(2).sum(-1))
    with pytest.raises(fxrt.InputError, match="input 0"):
        cg(torch.randn(3, 3, 2, 6))
