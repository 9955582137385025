"""OpInfo sweep: every op of PyTorch's OpInfo database that supports float32 on CPU, compiled with
``torch.compile(fn, backend="fxrt", fullgraph=False, dynamic=False)`` (or ``dynamic=True``, below)
and compared with eager, through both fxrt loops.

For every op (and its in-place / ``out=`` variant where the OpInfo has one) the first few samples
of ``op.sample_inputs("cpu", torch.float32, requires_grad=False)`` are made into a function of the
sample's tensors and run

* in eager, twice: the two results must agree bit for bit, or the op is random and belongs in
  ``NONDETERMINISTIC`` (or, rounding only, in ``BITWISE_UNSTABLE``);
* compiled with fxrt and ``options={"pure_python": True}``: every graph must run on the Python loop;
* compiled with fxrt and the default options: every graph must run on the loop the default selects
  (the compiled one when the extension is built and usable, else the Python one).

Each compiled function is called twice, each time on fresh copies of the inputs: the first call
on the sample's values, the second on perturbed copies (every floating-point value mapped to
``0.75 * x + 0.125``, which keeps signs of large values, order, [-1, 1] and [0, 1] ranges and
positive-definiteness, so the sample stays valid), compared with eager on the same perturbed
copies. The second call runs the cached program with other values, so a result that lives in
memory the program reuses from call to call (an arena slot) changes under the first call's
feet, which must not happen: the first call's result is checked again, bit for bit, after the
second. Samples whose perturbed copies eager rejects keep their values for the second call. For
each call, the whole result
pytree (tensors, numbers, None, torch.Size, namedtuples) and every tensor argument after the call
(in-place and ``out=`` writes must reach the caller's tensors) must match eager with float32
tolerances (raised to the OpInfo's own float32 CPU overrides where it has them), and so must which
result tensors share storage with which arguments or other results, and the result strides. The
two loops run the same program with the same kernels, so they must agree bit for bit.

The baseline is ``aot_eager``: when fxrt fails or mismatches on a sample, the sample is rerun with
``backend="aot_eager"`` and the same checks; if that fails too, the sample is excluded (an op whose
every sample is excluded is skipped with ``aot_eager fails too: <error>``). Otherwise it is an fxrt
failure. Random and uninitialized-memory ops are skipped, with the reason, in ``NONDETERMINISTIC``;
every other exception is in ``KNOWN_EXCEPTIONS`` with its reason.

The FAST subset (``FAST_OPS``, 2 samples each) runs with the normal test suite. The full sweep
(every op, 3 samples) runs with::

    FXRT_SWEEP=full .venv/bin/python -m pytest -q tests/test_opinfo.py

(``make sweep``); it prints a summary at the end (counts, every skip with its reason, samples
excluded, ops no graph of which reached fxrt, failures) and writes it to ``$FXRT_SWEEP_SUMMARY``
(default: ``fxrt_opinfo_summary.txt`` in the temp directory). ``FXRT_SWEEP_SAMPLES=n`` sets the
number of samples per op and variant.

``FXRT_SWEEP_DYNAMIC=1`` runs the sweep (fast or full) with ``dynamic=True`` in every
``torch.compile`` of it, fxrt's on both loops and the ``aot_eager`` baseline alike, so fxrt gets
graphs with symbolic sizes (Dynamo still specializes sizes 0 and 1); the inputs are the same, so
eager still gives the expected results. Those cases' ids end in ``-dynamic``; the summary's first
line says ``dynamic=True`` and how many graphs had symbolic sizes. The same exception lists apply;
samples that fail only with symbolic sizes in Dynamo itself (some ``out=`` metas call ``numel()``)
fail with ``aot_eager`` too and are excluded like any other. Without the variable, the normal test
suite still runs a few cases of the FAST subset with ``dynamic=True`` (``DYNAMIC_FAST_OPS``).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch._dynamo
from conftest import native_available, recording_compiles
from torch.utils._pytree import tree_flatten, tree_unflatten

import fxrt

FULL = os.environ.get("FXRT_SWEEP", "").strip().lower() == "full"
N_SAMPLES = int(os.environ.get("FXRT_SWEEP_SAMPLES", "3" if FULL else "2"))
DYNAMIC = os.environ.get("FXRT_SWEEP_DYNAMIC", "").strip().lower() in ("1", "true", "yes")
SUMMARY_PATH = os.environ.get(
    "FXRT_SWEEP_SUMMARY", os.path.join(tempfile.gettempdir(), "fxrt_opinfo_summary.txt")
)
DTYPE = torch.float32

# Ops whose eager result is random or reads uninitialized memory, so no compiled run can be
# compared with it. Every entry says why.
NONDETERMINISTIC: dict[str, str] = {
    # random number generators
    "bernoulli": "random: draws from Bernoulli(p)",
    "cauchy": "random: fills with Cauchy samples",
    "exponential": "random: fills with exponential samples",
    "geometric": "random: fills with geometric samples",
    "log_normal": "random: fills with log-normal samples",
    "multinomial": "random: samples indices",
    "normal": "random: draws from N(mean, std)",
    "normal.in_place": "random: fills with normal samples",
    "normal.number_mean": "random: draws from N(mean, std)",
    "uniform": "random: fills with uniform samples (uniform_)",
    "rand_like": "random: uniform samples",
    "randint": "random: integer samples",
    "randint_like": "random: integer samples",
    "randn": "random: normal samples",
    "randn_like": "random: normal samples",
    "nn.functional.fractional_max_pool2d": "random: samples pooling regions",
    "nn.functional.fractional_max_pool3d": "random: samples pooling regions",
    "svd_lowrank": "random: randomized range finder (torch.randn inside)",
    "pca_lowrank": "random: randomized range finder (torch.randn inside)",
    # uninitialized memory
    "empty": "uninitialized memory: torch.empty",
    "empty_like": "uninitialized memory: torch.empty_like",
    "empty_strided": "uninitialized memory: torch.empty_strided",
    "empty_permuted": "uninitialized memory: torch.empty_permuted",
    "new_empty": "uninitialized memory: Tensor.new_empty",
    "new_empty_strided": "uninitialized memory: Tensor.new_empty_strided",
}


def _drops_at_random(training_default: bool) -> Callable[[Any], bool]:
    """A dropout sample is random when it trains with 0 < p < 1 (p=0 keeps all, p=1 none)."""

    def random(sample: Any) -> bool:
        p = sample.kwargs.get("p", sample.args[0] if sample.args else 0.5)
        return bool(sample.kwargs.get("training", training_default)) and 0.0 < p < 1.0

    return random


# Ops whose samples are random only in some modes: op -> (is this sample random?, the reason).
# Those samples are skipped; the deterministic ones (training=False, p in {0, 1}) are tested.
RANDOM_SAMPLES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "nn.functional.dropout": (_drops_at_random(True), "random: dropout mask (training, 0<p<1)"),
    "nn.functional.dropout2d": (_drops_at_random(True), "random: channel mask (training, 0<p<1)"),
    "nn.functional.dropout3d": (_drops_at_random(True), "random: channel mask (training, 0<p<1)"),
    "nn.functional.alpha_dropout": (_drops_at_random(False), "random: mask (training, 0<p<1)"),
    "nn.functional.feature_alpha_dropout.with_train": (
        _drops_at_random(False),
        "random: channel mask (training, 0<p<1)",
    ),
    "nn.functional.rrelu": (
        lambda s: bool(s.kwargs.get("training", False)),
        "random: samples the negative slope when training",
    ),
}

# Ops whose eager kernel is deterministic only up to rounding: the same inputs give results that
# differ in the last bits from run to run. Where the sweep otherwise asks for bit-equality (eager
# against itself, the two fxrt loops against each other) these are compared with the op's
# tolerances instead; the comparison with eager is the same as for every op.
BITWISE_UNSTABLE: dict[str, str] = {
    # MKL's LAPACK (xGELSY and friends) picks code paths by the alignment of the buffers it is
    # given and of the workspace it allocates: measured, 3 distinct results in 20 identical calls.
    "linalg.lstsq": "MKL LAPACK results depend on buffer alignment (driver='gelsy')",
    "linalg.lstsq.grad_oriented": "MKL LAPACK results depend on buffer alignment",
}

# Every other exception, with its reason: (op name, variant) -> reason, skipped as a whole. These
# are cases no sample of which runs in eager on CPU, so there is nothing to compare with; a case
# like that which is not listed here fails, so that none goes unnoticed.
_CUDA_ONLY = "jiterator ops are CUDA/ROCm only: eager raises on CPU"
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("jiterator_unary", "function"): _CUDA_ONLY,
    ("jiterator_binary", "function"): _CUDA_ONLY,
    ("jiterator_binary_return_by_ref", "function"): _CUDA_ONLY,
    ("jiterator_2inputs_2outputs", "function"): _CUDA_ONLY,
    ("jiterator_4inputs_with_extra_args", "function"): _CUDA_ONLY,
    ("float_power", "inplace"): "float_power_ on float32 needs a float64 result: eager rejects it",
    ("equal", "out"): "torch.equal returns a Python bool: there is no tensor to write with out=",
    ("_batch_norm_with_update", "out"): (
        "its out= overload takes out, save_mean, save_invstd and reserve by name: out=(...) "
        "matches no schema in eager"
    ),
    ("histogramdd", "out"): (
        "the samples pass bins as ints; with out= only the Tensor[] bins overload exists, so eager "
        "raises"
    ),
}

# The FAST subset run by the normal test suite: op name -> variants. 78 ops covering
# elementwise unary/binary, reductions, views/reshapes/indexing, matmul/linear/conv, normalization,
# softmax, cat/stack/split, in-place and out= variants, multiple outputs and scalar outputs.
_F, _I, _O = ("function",), ("function", "inplace"), ("function", "out")
FAST_OPS: dict[str, tuple[str, ...]] = {
    # elementwise unary
    "abs": _F,
    "exp": _F,
    "sin": _F,
    "sigmoid": _I,
    "sqrt": _F,
    "nn.functional.relu": _F,
    "nn.functional.gelu": _F,
    "nan_to_num": _F,
    "clamp": ("function", "inplace", "out"),
    "frexp": _F,  # two outputs, one of them int
    # elementwise binary / ternary
    "add": ("function", "inplace", "out"),
    "mul": _I,
    "div.no_rounding_mode": _F,
    "pow": _F,
    "maximum": _F,
    "atan2": _F,
    "eq": _F,
    "where": _F,
    "lerp": _F,
    "addcmul": _I,
    # reductions
    "sum": _F,
    "mean": _O,
    "var": _F,
    "argmax": _F,
    "logsumexp": _F,
    "cumsum": _F,
    "any": _F,
    "max.reduction_with_dim": _O,  # (values, indices) namedtuple
    "var_mean": _F,
    "aminmax": _F,
    # views, reshapes, indexing
    "view": _F,
    "reshape": _F,
    "permute": _F,
    "transpose": _F,
    "expand": _F,
    "squeeze": _F,
    "unsqueeze": _I,  # unsqueeze_: an in-place view op
    "narrow": _F,
    "select": _F,
    "as_strided": _F,
    "diagonal": _F,
    "__getitem__": _F,
    "index_select": _F,
    "gather": _F,
    "scatter": _F,
    "index_put": _F,
    "index_add": _F,
    "masked_fill": _I,
    "take_along_dim": _F,
    # matmul, linear, conv
    "mm": _O,
    "bmm": _F,
    "addmm": _F,
    "matmul": _F,
    "nn.functional.linear": _F,
    "nn.functional.conv2d": _F,
    "einsum": _F,
    # normalization, pooling, softmax
    "nn.functional.layer_norm": _F,
    "native_layer_norm": _F,  # three outputs
    "nn.functional.batch_norm": _F,
    "nn.functional.group_norm": _F,
    "nn.functional.max_pool2d": _F,
    "softmax": _F,
    "nn.functional.cross_entropy": _F,
    # cat / stack / split
    "cat": _O,
    "stack": _F,
    "split": _F,
    "chunk": _F,
    "unbind": _F,
    # multiple outputs, sorting
    "sort": _O,
    "topk": _F,
    # scalar and non-tensor outputs
    "item": _F,
    "equal": _F,
    "allclose": _F,
    "broadcast_shapes": _F,
    # creation, in-place fills
    "full_like": _F,
    "arange": _F,
    "zero_": _F,
    "fill": _I,
}

# The FAST cases the normal test suite also runs with dynamic=True (ids ending in "-dynamic"):
# ops whose graphs compute with symbolic sizes (view/reshape targets, cat and index output sizes,
# expand, arange's length, reduction and matmul shapes).
DYNAMIC_FAST_OPS: dict[str, tuple[str, ...]] = {
    "view": _F,
    "reshape": _F,
    "expand": _F,
    "narrow": _F,
    "cat": _F,
    "__getitem__": _F,
    "index_select": _F,
    "sum": _F,
    "matmul": _F,
    "softmax": _F,
    "arange": _F,
}


def op_id(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _load_op_db() -> list[Any]:
    """PyTorch's OpInfo database. Importing it freezes ``torch.backends`` flags for the whole
    process (common_utils calls ``torch.backends.disable_global_flags()``); that is undone, so
    that collecting this file changes nothing for the other tests of the session."""
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_methods_invocations import op_db

    if not frozen:  # the module globals flags_frozen() reads (not vars(torch.backends))
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    return op_db


_OPS = {op_id(op): op for op in _load_op_db() if DTYPE in op.supported_dtypes("cpu")}
_MISSING = sorted(set(FAST_OPS) - set(_OPS))
assert not _MISSING, f"FAST_OPS names unknown to op_db: {_MISSING}"
_NOT_FAST = [
    (k, v) for k, vs in DYNAMIC_FAST_OPS.items() for v in vs if v not in FAST_OPS.get(k, ())
]
assert not _NOT_FAST, f"DYNAMIC_FAST_OPS cases not in FAST_OPS: {_NOT_FAST}"


def _variants(op: Any) -> tuple[str, ...]:
    v = ["function"]
    if op.inplace_variant is not None:
        v.append("inplace")
    if op.supports_out:
        v.append("out")
    return tuple(v)


def case_id(name: str, variant: str, dynamic: bool) -> str:
    return f"{name}-{variant}" + ("-dynamic" if dynamic else "")


def _split_case_id(key: str) -> tuple[str, str, bool]:
    """(op name, variant, dynamic) of a case id; op names may contain "-" (nearest-exact)."""
    dynamic = key.endswith("-dynamic")
    name, variant = key.removesuffix("-dynamic").rsplit("-", 1)
    return name, variant, dynamic


def _cases() -> list[Any]:
    cases = []
    for name, op in _OPS.items():
        variants = _variants(op) if FULL else FAST_OPS.get(name, ())
        for variant in variants:
            if variant not in _variants(op):
                raise AssertionError(f"FAST_OPS: {name} has no {variant} variant")
            marks = [pytest.mark.slow] if FULL else []
            modes = [DYNAMIC]
            if not DYNAMIC and not FULL and variant in DYNAMIC_FAST_OPS.get(name, ()):
                modes.append(True)
            for dynamic in modes:
                id_ = case_id(name, variant, dynamic)
                cases.append(pytest.param(name, variant, dynamic, id=id_, marks=marks))
    return cases


# --------------------------------------------------------------------------------------------
# Running one sample


def _tolerances(op: Any) -> tuple[float, float]:
    """(rtol, atol) for float32: torch.testing's defaults, loosened to the largest float32 CPU
    override the OpInfo declares."""
    from torch.testing._internal.common_device_type import toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo

    rtol, atol = 1.3e-6, 1e-5
    for d in op.decorators:
        if not isinstance(d, DecorateInfo) or d.device_type not in (None, "cpu"):
            continue
        if d.dtypes is not None and DTYPE not in d.dtypes:
            continue
        for dec in d.decorators:
            if isinstance(dec, toleranceOverride) and DTYPE in dec.d:
                rtol, atol = max(rtol, dec.d[DTYPE].rtol), max(atol, dec.d[DTYPE].atol)
    return rtol, atol


def _copy_tensors(tensors: Sequence[torch.Tensor], perturb: bool = False) -> list[torch.Tensor]:
    """Deep copies that keep sizes, strides, storage offsets (also overlapping ones) and which
    tensors share a storage, so every run sees exactly the sample's inputs; with ``perturb``,
    every floating-point (and complex) value ``x`` becomes ``0.75 * x + 0.125`` (integers and
    bools, often indices and masks, stay as they are)."""
    storages: dict[int, torch.UntypedStorage] = {}
    out = []
    for t in tensors:
        if t.layout != torch.strided or t.is_conj() or t.is_neg():
            c = t.clone()
            if perturb and (c.is_floating_point() or c.is_complex()):
                c = c * 0.75 + 0.125
            out.append(c)
            continue
        s = t.untyped_storage()
        key = s.data_ptr() if s.nbytes() else id(t)
        if key not in storages:
            storages[key] = s.clone()
            if perturb and (t.is_floating_point() or t.is_complex()) and s.nbytes():
                whole = torch.empty(0, dtype=t.dtype, device=t.device)
                whole.set_(storages[key], 0, (s.nbytes() // t.element_size(),))
                whole.mul_(0.75).add_(0.125)  # the whole storage: views of it agree
        c = torch.empty(0, dtype=t.dtype, device=t.device)
        c.set_(storages[key], t.storage_offset(), t.size(), t.stride())
        out.append(c)
    return out


@dataclass
class Case:
    """One (op, variant, sample) made into a function of its tensors."""

    fn: Callable[..., Any]
    tensors: list[torch.Tensor]
    desc: str


def _make_case(op: Any, variant: str, sample: Any, out_like: Any = None) -> Case:
    kwargs = dict(sample.kwargs)
    if variant == "out":
        kwargs["out"] = out_like
    target = op.inplace_variant if variant == "inplace" else op.op
    leaves, spec = tree_flatten((sample.input, tuple(sample.args), kwargs))
    tpos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def fn(*tensors: torch.Tensor) -> Any:
        vals = list(leaves)
        for i, t in zip(tpos, tensors):
            vals[i] = t
        inp, args, kw = tree_unflatten(vals, spec)
        return target(inp, *args, **kw)

    return Case(fn, [leaves[i] for i in tpos], _describe_sample(sample))


def _describe_sample(sample: Any) -> str:
    def d(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(d(y) for y in x) + "]"
        return repr(x)

    parts = [d(sample.input)] + [d(a) for a in sample.args]
    parts += [f"{k}={d(v)}" for k, v in sample.kwargs.items()]
    return ", ".join(parts)[:300]


def _run(case: Case, perturb: bool = False) -> tuple[Any, list[torch.Tensor]]:
    """Run the case eagerly on fresh (``perturb``: perturbed) copies of its tensors. Returns
    (result, the tensor arguments after the call)."""
    args = _copy_tensors(case.tensors, perturb)
    return case.fn(*args), args


def _run_compiled(
    case: Case, compile_with: dict[str, Any], dynamic: bool = False, perturb: bool = True
) -> list[tuple[Any, list[torch.Tensor]]]:
    """Compile the case with ``torch.compile(dynamic=dynamic, **compile_with)`` and call it twice,
    each time on fresh copies of its tensors, the second time perturbed (unless ``perturb`` is
    False): the second call runs what the first one compiled, on other values, and must leave
    the first call's result as it was. Returns both calls' (result, arguments after the call)."""
    torch._dynamo.reset()  # no cache entries (or recompile counts) carried between runs
    compiled = torch.compile(case.fn, fullgraph=False, dynamic=dynamic, **compile_with)
    args = _copy_tensors(case.tensors)
    first = compiled(*args), args
    kept = _snapshot(first)
    args = _copy_tensors(case.tensors, perturb)
    second = compiled(*args), args
    assert_same(first, kept, 0.0, 0.0, "the first call's result and arguments after a second call")
    return [first, second]


def _snapshot(x: Any) -> Any:
    """A copy of a result pytree with every tensor cloned and container types kept."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, list):
        return [_snapshot(y) for y in x]
    if isinstance(x, tuple) and not isinstance(x, torch.Size):
        items = [_snapshot(y) for y in x]
        if type(x) is tuple:
            return tuple(items)
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)  # structseq
    if isinstance(x, dict):
        return {k: _snapshot(v) for k, v in x.items()}
    return x


_PURE_PYTHON = {"backend": "fxrt", "options": {"pure_python": True}}
_DEFAULT = {"backend": "fxrt"}
_AOT_EAGER = {"backend": "aot_eager"}


# --------------------------------------------------------------------------------------------
# Comparing results


def assert_same(actual: Any, expected: Any, rtol: float, atol: float, path: str = "out") -> None:
    """Compare two result pytrees: structure and container types, tensors with assert_close
    (shape, dtype, device, layout; NaN equal to NaN), numbers with the same tolerances, anything
    else with ``==``."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual)}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        if expected.layout != torch.strided:
            actual, expected = actual.to_dense(), expected.to_dense()
        torch.testing.assert_close(
            actual, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{path}: {m}"
        )
        return
    if isinstance(expected, (tuple, list)):  # also torch.Size and return_types namedtuples
        assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, rtol, atol, f"{path}[{i}]")
        return
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{path}: expected a mapping, got {type(actual)}"
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_same(actual[k], expected[k], rtol, atol, f"{path}[{k!r}]")
        return
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, float) and not (math.isnan(expected) and math.isnan(actual)):
        assert math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol), (
            f"{path}: {actual!r} != {expected!r}"
        )
    elif not isinstance(expected, float):
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _check(got: tuple[Any, list[torch.Tensor]], want: tuple[Any, list[torch.Tensor]], tol) -> None:
    assert_same(got[0], want[0], *tol, "result")
    assert_same(got[1], want[1], *tol, "args after the call")
    got_alias, want_alias = alias_pattern(*got), alias_pattern(*want)
    assert got_alias == want_alias, (
        f"aliasing differs: (result tensor, tensors it shares storage with) {got_alias} != "
        f"{want_alias} (eager)"
    )
    got_strides, want_strides = _strides(got[0]), _strides(want[0])
    assert got_strides == want_strides, f"result strides {got_strides} != {want_strides} (eager)"


def _storage_key(t: torch.Tensor) -> int | None:
    if t.layout != torch.strided or not t.untyped_storage().nbytes():
        return None
    return t.untyped_storage().data_ptr()


def alias_pattern(result: Any, args: list[torch.Tensor]) -> list[tuple[int, list[str]]]:
    """Which argument tensors (``a<i>``) and which earlier result tensors (``r<j>``) each result
    tensor shares storage with: a write to it would show there, in eager as compiled."""
    outs = [x for x in tree_flatten(result)[0] if isinstance(x, torch.Tensor)]
    keys_in = [_storage_key(a) for a in args]
    keys_out = [_storage_key(o) for o in outs]
    pattern = []
    for i, k in enumerate(keys_out):
        if k is None:
            continue
        shared = [f"a{j}" for j, kj in enumerate(keys_in) if kj == k]
        shared += [f"r{j}" for j, kj in enumerate(keys_out[:i]) if kj == k]
        if shared:
            pattern.append((i, shared))
    return pattern


def _strides(result: Any) -> list[tuple[int | None, ...] | None]:
    """Result strides, where they mean something: dims of size 0 or 1 have no stride to speak
    of, nor has an empty tensor."""
    return [
        tuple(st if sz > 1 else None for sz, st in zip(x.shape, x.stride()))
        if x.layout == torch.strided and x.numel() > 0
        else None
        for x in tree_flatten(result)[0]
        if isinstance(x, torch.Tensor)
    ]


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:240]


# --------------------------------------------------------------------------------------------
# Which loop ran


def default_executor() -> str:
    """The loop the default options select: the compiled one when the extension is built and
    usable (and FXRT_PURE_PYTHON is not set), else the Python one. Every graph compiled with the
    default options must run on it; a silent per-graph fallback to Python would be a bug."""
    if fxrt.CompilerConfig().pure_python or not native_available():
        return "python"
    return "cpp"


def _check_executors(graphs: list[Any], expected: str, what: str) -> None:
    execs = sorted({getattr(g, "executor", "?") for g in graphs})
    assert all(e == expected for e in execs), f"{what}: graphs ran on {execs}, want {expected!r}"


# --------------------------------------------------------------------------------------------
# Summary


@dataclass
class _Record:
    outcome: str = "?"  # passed / failed / skipped
    reason: str = ""
    samples_passed: int = 0
    # samples where fxrt failed and aot_eager fails too: (index, aot_eager's error, fxrt's)
    samples_excluded: list[tuple[int, str, str]] = field(default_factory=list)
    fxrt_graphs: int = 0
    fxrt_graphs_with_nodes: int = 0  # Dynamo also hands over graphs with no node


_RECORDS: dict[str, _Record] = {}
_EXECUTORS: Counter[str] = Counter()
_SYMBOLIC: Counter[str] = Counter()  # graphs with nodes and symbolic sizes, per executor
_EMPTY: Counter[str] = Counter()  # graphs with no node, per executor


def has_symbolic_sizes(cg: Any) -> bool:
    """Whether a compiled graph has a SymInt value or a tensor with a symbolic size or stride:
    what ``dynamic=True`` is meant to give fxrt."""
    from fxrt.ir import ValueKind

    return any(
        v.kind is ValueKind.SYM or (v.meta is not None and not v.meta.is_static)
        for v in cg.graph.values
    )


class _SummaryPlugin:
    def pytest_runtest_logreport(self, report: Any) -> None:
        name = report.nodeid.rsplit("[", 1)[-1].rstrip("]")
        if "test_opinfo.py::test_op" not in report.nodeid or name not in _RECORDS:
            return
        rec = _RECORDS[name]
        if report.failed:
            rec.outcome = "failed"
            lines = str(report.longrepr).strip().splitlines()
            rec.reason = " | ".join(lines[:3])[:400]
        elif report.skipped and rec.outcome != "failed":
            rec.outcome = "skipped"
            lr = report.longrepr
            rec.reason = lr[2] if isinstance(lr, tuple) else str(lr)
            rec.reason = rec.reason.removeprefix("Skipped: ")
        elif report.when == "call" and report.passed:
            rec.outcome = "passed"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        text = summary_text()
        terminalreporter.write_sep("=", "fxrt OpInfo sweep summary")
        if FULL:
            with open(SUMMARY_PATH, "w") as f:
                f.write(text + "\n")
            terminalreporter.write_line(text)
            terminalreporter.write_line(f"(written to {SUMMARY_PATH})")
        else:  # the fast subset: the counts only
            terminalreporter.write_line("\n".join(text.splitlines()[:2]))


def summary_text() -> str:
    """Counts per outcome, then every skip with its reason, exclusions and failures."""
    recs = {k: r for k, r in sorted(_RECORDS.items()) if r.outcome != "?"}
    by = Counter(r.outcome for r in recs.values())
    cats: dict[str, list[str]] = {
        "random/uninitialized": [],
        "aot_eager fails too": [],
        "listed exception": [],
        "other": [],
    }
    prefixes = {
        "random/uninitialized": ("random", "uninitialized"),
        "aot_eager fails too": ("aot_eager fails too",),
        "listed exception": ("known exception",),
    }
    for k, r in recs.items():
        if r.outcome == "skipped":
            cat = next((c for c, p in prefixes.items() if r.reason.startswith(p)), "other")
            fxrt_err = f" / fxrt: {r.samples_excluded[0][2]}" if r.samples_excluded else ""
            cats[cat].append(f"{k}: {r.reason}{fxrt_err}")
    # An op passes when none of its variants failed and at least one ran and passed.
    ops: dict[str, list[_Record]] = {}
    for k, r in recs.items():
        name, _, dynamic = _split_case_id(k)
        ops.setdefault(name + ("-dynamic" if dynamic else ""), []).append(r)
    ops_passed = sum(
        all(r.outcome != "failed" for r in rs) and any(r.outcome == "passed" for r in rs)
        for rs in ops.values()
    )
    ops_failed = sum(any(r.outcome == "failed" for r in rs) for rs in ops.values())
    n_dynamic = sum(_split_case_id(k)[2] for k in recs)
    dynamic = f"{DYNAMIC}" if DYNAMIC or not n_dynamic else f"False (True in {n_dynamic} cases)"
    lines = [
        f"mode={'full' if FULL else 'fast'} dynamic={dynamic} samples/op<={N_SAMPLES} "
        f"default executor={default_executor()} graphs run per executor: {dict(_EXECUTORS)} "
        f"(empty: {dict(_EMPTY)}; with symbolic sizes: {dict(_SYMBOLIC)})",
        f"cases (op x variant): {len(recs)}; passed {by['passed']}, failed {by['failed']}, "
        f"skipped {by['skipped']} ({', '.join(f'{k}: {len(v)}' for k, v in cats.items())})",
        f"ops: {len(ops)}; passed {ops_passed}, failed {ops_failed}, "
        f"not run {len(ops) - ops_passed - ops_failed}; "
        f"samples passed: {sum(r.samples_passed for r in recs.values())}",
    ]
    for k, v in cats.items():
        if v:
            lines.append(f"skipped, {k}:")
            lines += [f"  {x}"[:400] for x in v]
    partial = [(k, r) for k, r in recs.items() if r.outcome == "passed" and r.samples_excluded]
    if partial:
        lines.append("passed, with some samples excluded because aot_eager fails too:")
        for k, r in partial:
            for i, aot_err, fxrt_err in r.samples_excluded:
                lines.append(f"  {k} sample {i}: aot_eager: {aot_err} / fxrt: {fxrt_err}"[:400])
    no_graph = [k for k, r in recs.items() if r.outcome == "passed" and not r.fxrt_graphs]
    if no_graph:
        lines.append("passed without any graph reaching fxrt (Dynamo ran them eagerly):")
        lines.append("  " + " ".join(no_graph))
    only_empty = [
        k
        for k, r in recs.items()
        if r.outcome == "passed" and r.fxrt_graphs and not r.fxrt_graphs_with_nodes
    ]
    if only_empty:
        lines.append("passed with only graphs of no node reaching fxrt:")
        lines.append("  " + " ".join(only_empty))
    failed = [f"  {k}: {r.reason}" for k, r in recs.items() if r.outcome == "failed"]
    if failed:
        lines.append("FAILED:")
        lines += failed
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest) -> Iterator[None]:
    pm = request.config.pluginmanager
    if not pm.has_plugin("fxrt-opinfo-summary"):
        pm.register(_SummaryPlugin(), "fxrt-opinfo-summary")
    # torch's structured-trace logger logs every compile at DEBUG; kept out of the log pytest
    # reports with a failure, the report stays readable.
    handler = getattr(pm.get_plugin("logging-plugin"), "report_handler", None)
    if handler is not None:
        handler.addFilter(_drop_trace_records)
    yield
    if handler is not None:
        handler.removeFilter(_drop_trace_records)


def _drop_trace_records(record: logging.LogRecord) -> bool:
    return not record.name.startswith("torch.__trace")


# --------------------------------------------------------------------------------------------
# The test


def _samples(op: Any) -> Iterator[Any]:
    torch.manual_seed(0)
    return iter(op.sample_inputs("cpu", DTYPE, requires_grad=False))


@pytest.mark.parametrize(("name", "variant", "dynamic"), _cases())
def test_op(name: str, variant: str, dynamic: bool) -> None:
    rec = _RECORDS.setdefault(case_id(name, variant, dynamic), _Record())
    if name in NONDETERMINISTIC:
        pytest.skip(NONDETERMINISTIC[name])
    if (name, variant) in KNOWN_EXCEPTIONS:
        pytest.skip("known exception: " + KNOWN_EXCEPTIONS[(name, variant)])
    op = _OPS[name]
    tol = _tolerances(op)
    exact = tol if name in BITWISE_UNSTABLE else (0.0, 0.0)  # for "the same run twice"
    want_default = default_executor()
    failures: list[str] = []
    eager_errors: list[str] = []
    random_skips: list[str] = []
    tried = 0
    for i, sample in enumerate(itertools.islice(_samples(op), 3 * N_SAMPLES)):
        if tried >= N_SAMPLES:
            break
        if name in RANDOM_SAMPLES and RANDOM_SAMPLES[name][0](sample):
            random_skips.append(f"sample {i}")
            continue
        out_like = None
        if variant == "out":
            try:
                ref = _make_case(op, "function", sample).fn(*_copy_tensors(_tensors_of(sample)))
            except Exception as e:
                eager_errors.append(f"sample {i}: {_first_line(e)}")
                continue
            out_like = _out_buffers(ref)
            if out_like is None:
                eager_errors.append(f"sample {i}: result has non-tensor leaves, no out=")
                continue
        case = _make_case(op, variant, sample, out_like)
        try:
            expected = _run(case)
        except Exception as e:  # not a valid sample for this variant (e.g. in-place broadcast)
            eager_errors.append(f"sample {i}: {_first_line(e)}")
            continue
        try:  # the second calls' inputs, and what eager gives on them
            expected_perturbed, perturb = _run(case, perturb=True), True
        except Exception:  # perturbed values outside the op's domain: keep the sample's
            expected_perturbed, perturb = expected, False
        expected_runs = (expected, expected_perturbed)
        tried += 1
        again = _run(case)
        try:
            _check(again, expected, exact)
        except AssertionError as e:
            raise AssertionError(
                f"{name}: eager gives different results on the same inputs ({e}); "
                "if the op is random, add it to NONDETERMINISTIC with the reason"
            ) from None

        problems = []
        results = {}
        for label, cfg, want in (
            ("pure_python", _PURE_PYTHON, "python"),
            ("default", _DEFAULT, want_default),
        ):
            try:
                with recording_compiles() as graphs:
                    runs = _run_compiled(case, cfg, dynamic, perturb)
                rec.fxrt_graphs += len(graphs)
                rec.fxrt_graphs_with_nodes += sum(bool(g.graph.nodes) for g in graphs)
                _EXECUTORS.update(g.executor for g in graphs)
                _EMPTY.update(g.executor for g in graphs if not g.graph.nodes)
                _SYMBOLIC.update(
                    g.executor for g in graphs if g.graph.nodes and has_symbolic_sizes(g)
                )
                _check_executors(graphs, want, label)
                for run, want_run in zip(runs, expected_runs, strict=True):
                    _check(run, want_run, tol)
                results[label] = runs[0]
            except Exception as e:
                detail = "".join(traceback.format_exception_only(type(e), e)).strip()
                problems.append(f"[{label}] {detail[:2000]}")
        if not problems:
            try:  # same program, same kernels: the two loops agree bit for bit
                _check(results["default"], results["pure_python"], exact)
            except AssertionError as e:
                problems.append(f"[default vs pure_python] {e}")
        if not problems:
            rec.samples_passed += 1
            continue
        try:
            for run, want_run in zip(
                _run_compiled(case, _AOT_EAGER, dynamic, perturb), expected_runs, strict=True
            ):
                _check(run, want_run, tol)
        except Exception as e:
            fxrt_problem = problems[0].splitlines()[0][:200]
            rec.samples_excluded.append((i, _first_line(e), fxrt_problem))
            continue
        failures.append(f"sample {i} ({case.desc}):\n" + "\n".join(problems))

    if failures:
        pytest.fail(
            f"{name} ({variant}): fxrt differs from eager, aot_eager does not:\n\n"
            + "\n\n".join(failures),
            pytrace=False,
        )
    if rec.samples_passed:
        return
    if rec.samples_excluded:
        pytest.skip("aot_eager fails too: " + rec.samples_excluded[0][1])
    if random_skips and not eager_errors:
        pytest.skip(RANDOM_SAMPLES[name][1] + f" (all of {len(random_skips)} samples)")
    pytest.fail(
        f"{name} ({variant}): no sample runs in eager"
        + (f" ({'; '.join(eager_errors[:3])})" if eager_errors else " (no samples)")
        + ": nothing was compared; if that is expected, list it in KNOWN_EXCEPTIONS with why",
        pytrace=False,
    )


def _tensors_of(sample: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _out_buffers(result: Any) -> Any:
    """out= buffers shaped like the eager result (NaN-filled floats, so a write that does not
    happen is seen); None when the result is not tensors."""
    leaves, spec = tree_flatten(result)
    if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
        return None
    bufs = [
        torch.full_like(x, math.nan) if x.is_floating_point() else torch.zeros_like(x)
        for x in leaves
    ]
    out = tree_unflatten(bufs, spec)  # the result's nesting: (hist, [edges]) for histogramdd
    return tuple(out) if isinstance(out, tuple) else out  # out= takes a plain tuple
