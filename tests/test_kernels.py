"""Kernel libraries, custom ops and kernel overrides (fxrt.ops.overrides), on both loops.

A small C++ op library is built once per source/torch version with
``torch.utils.cpp_extension.load`` (~30 s the first time) into a cached directory
(``$XDG_CACHE_HOME/fxrt-test-build/<hash>`` or ``/tmp/fxrt-test-build/<hash>``). It is built in a
subprocess so that this process loads it for the first time through ``fxrt.load_kernel_library``.
It defines ``fxrt_test::scaled_add`` (a new op), ``fxrt_test::gelu_counted`` (gelu that counts its
calls, read by ``fxrt_test::gelu_calls``) and declares ``aten::gelu -> fxrt_test::gelu_counted``
through fxrt's ``extern "C" fxrt_register_kernels`` entry point.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import compile_and_run, skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt import cache
from fxrt.ops import overrides

LIBRARY_SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>

namespace {

std::atomic<int64_t> gelu_calls{0};

at::Tensor scaled_add(const at::Tensor& a, const at::Tensor& b, double alpha) {
  return a + b * alpha;
}

at::Tensor scaled_add_meta(const at::Tensor& a, const at::Tensor& b, double alpha) {
  return at::empty_like(a);
}

at::Tensor gelu_counted(const at::Tensor& x, c10::string_view approximate) {
  ++gelu_calls;
  return at::gelu(x, approximate);
}

at::Tensor gelu_counted_meta(const at::Tensor& x, c10::string_view approximate) {
  return at::empty_like(x);
}

int64_t calls() { return gelu_calls.load(); }

}  // namespace

TORCH_LIBRARY(fxrt_test, m) {
  m.def("scaled_add(Tensor a, Tensor b, float alpha) -> Tensor");
  m.def("gelu_counted(Tensor x, *, str approximate='none') -> Tensor");
  m.def("gelu_calls() -> int");
}

TORCH_LIBRARY_IMPL(fxrt_test, CPU, m) {
  m.impl("scaled_add", scaled_add);
  m.impl("gelu_counted", gelu_counted);
}

TORCH_LIBRARY_IMPL(fxrt_test, Meta, m) {
  m.impl("scaled_add", scaled_add_meta);
  m.impl("gelu_counted", gelu_counted_meta);
}

TORCH_LIBRARY_IMPL(fxrt_test, CompositeExplicitAutograd, m) {
  m.impl("gelu_calls", calls);
}

extern "C" void fxrt_register_kernels(void (*reg)(const char* op, const char* replacement)) {
  reg("aten::gelu", "fxrt_test::gelu_counted");
}
"""

_BUILD = (
    "import sys\n"
    "from torch.utils.cpp_extension import load\n"
    "load(sys.argv[1], [sys.argv[2]], build_directory=sys.argv[3], is_python_module=False,"
    " extra_cflags=['-O1'])\n"
)


def _build_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or tempfile.gettempdir()
    key = hashlib.sha256(
        f"{LIBRARY_SOURCE}\0{torch.__version__}\0{sys.version}".encode()
    ).hexdigest()[:16]
    return Path(base) / "fxrt-test-build" / key


@pytest.fixture(scope="session")
def library() -> str:
    """The test library's path, built if the cache lacks it (not loaded here)."""
    name = "fxrt_test_kernels"
    out = _build_dir()
    so = out / f"{name}.so"
    if so.exists():
        return str(so)
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler to build the test kernel library")
    out.mkdir(parents=True, exist_ok=True)
    src = out / f"{name}.cpp"
    src.write_text(LIBRARY_SOURCE)
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD, name, str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 or not so.exists():
        pytest.fail(f"building the test kernel library failed:\n{proc.stdout}\n{proc.stderr}")
    return str(so)


@pytest.fixture(autouse=True)
def _restore_overrides(monkeypatch):
    """Each test starts with no overrides and leaves none behind."""
    monkeypatch.setattr(overrides, "_overrides", overrides.MappingProxyType({}))


def _compile(fn, inputs, executor, **config):
    skip_unless_executor(executor)
    gm = make_fx(fn)(*inputs)
    cfg = fxrt.CompilerConfig(pure_python=executor == "python", **{"cache": False, **config})
    cg = fxrt.compile_graph(gm, list(inputs), cfg)
    assert cg.executor == executor
    return cg


def _loop_fallbacks(cg) -> tuple[str, ...]:
    """Every node the graph runs through Python: the program's fallbacks, and for the compiled
    loop also ATen calls the dispatcher could not bind."""
    return cg._loop.fallbacks if cg.executor == "cpp" else cg.program.fallbacks


def _gelu_calls() -> int:
    return torch.ops.fxrt_test.gelu_calls()


# --- C++ kernel libraries -------------------------------------------------------------------


def test_load_kernel_library_reports_ops_and_overrides(library):
    lib = fxrt.load_kernel_library(library)
    assert lib.path == os.path.abspath(library)
    assert {"fxrt_test::scaled_add", "fxrt_test::gelu_counted"} <= set(lib.ops)
    assert lib.overrides == (("aten::gelu", "fxrt_test::gelu_counted"),)
    o = overrides.kernel_overrides()["aten::gelu"]
    assert o.target is torch.ops.fxrt_test.gelu_counted.default and o.source == lib.path
    # Loading again is harmless: same ops, and the entry point declares its overrides again.
    fxrt.unregister_kernel("aten::gelu")
    again = fxrt.load_kernel_library(Path(library))
    assert again.ops == lib.ops and "aten::gelu" in overrides.kernel_overrides()


def test_library_op_runs_natively(library, executor):
    fxrt.load_kernel_library(library)

    def f(x, y):
        return torch.ops.fxrt_test.scaled_add(x.sin(), y, 0.5) * 2

    x, y = torch.randn(3, 5), torch.randn(3, 5)
    cg = _compile(f, (x, y), executor)
    listing = str(cg.program)
    assert "CALL   %scaled_add = fxrt_test::scaled_add(" in listing
    assert "fallbacks:" not in listing
    assert cg.program.fallbacks == () and _loop_fallbacks(cg) == ()
    torch.testing.assert_close(cg(x, y), (x.sin() + 0.5 * y) * 2)


def test_library_op_through_torch_compile(library, executor):
    fxrt.load_kernel_library(library)
    fxrt.unregister_kernel("aten::gelu")

    def f(x, y):
        return torch.ops.fxrt_test.scaled_add(x, y, -1.5).relu()

    x, y = torch.randn(8), torch.randn(8)
    got = compile_and_run(f, (x, y), executor)
    torch.testing.assert_close(got, (x - 1.5 * y).relu())


def test_library_override_changes_the_kernel_in_fxrt_only(library, executor):
    fxrt.load_kernel_library(library)

    def f(x):
        return F.gelu(x, approximate="tanh") + F.gelu(x * 2)

    x = torch.randn(16)
    cg = _compile(f, (x,), executor)
    listing = str(cg.program)
    assert listing.count("fxrt_test::gelu_counted(") == 2
    assert "aten::gelu" not in listing and _loop_fallbacks(cg) == ()
    assert "approximate='tanh'" in listing  # the keyword argument was carried over
    before = _gelu_calls()
    got = cg(x)
    assert _gelu_calls() - before == 2  # the library's kernel ran, once per gelu node
    torch.testing.assert_close(got, f(x))
    before = _gelu_calls()
    f(x)  # eager PyTorch does not see the override
    assert _gelu_calls() == before


def test_override_through_torch_compile(library, executor):
    fxrt.load_kernel_library(library)
    x = torch.randn(4, 4)
    before = _gelu_calls()
    got = compile_and_run(torch.nn.GELU(), (x,), executor)
    assert _gelu_calls() - before == 1
    torch.testing.assert_close(got, F.gelu(x))


def test_registry_changes_the_cache_key(library, tmp_path):
    fxrt.load_kernel_library(library)
    fxrt.unregister_kernel("aten::gelu")
    x = torch.randn(8)
    gm = make_fx(lambda x: F.gelu(x))(x)
    cfg = fxrt.CompilerConfig(  # fxrt's own gelu off: the graph keeps aten::gelu
        pure_python=True, cache=True, cache_dir=str(tmp_path), own_ops=False
    )
    plain = fxrt.compile_graph(gm, [x], cfg)
    assert "aten::gelu(" in str(plain.program)

    fxrt.register_kernel("aten::gelu", "fxrt_test::gelu_counted")
    hits = cache.stats["hit"]
    overridden = fxrt.compile_graph(gm, [x], cfg)
    assert cache.stats["hit"] == hits, "a graph compiled without the override was reused"
    before = _gelu_calls()
    overridden(x)
    assert _gelu_calls() == before + 1

    fxrt.unregister_kernel("aten::gelu")
    again = fxrt.compile_graph(gm, [x], cfg)
    assert cache.stats["hit"] == hits + 1  # the first entry, under the first registry
    assert "aten::gelu(" in str(again.program)


# --- Python ops and overrides ---------------------------------------------------------------

_py_calls: list[str] = []


@torch.library.custom_op("fxrt_test_py::cubic", mutates_args=())
def cubic(x: torch.Tensor, scale: float) -> torch.Tensor:
    _py_calls.append("cubic")
    return x * x * x * scale


@cubic.register_fake
def _(x, scale):
    return torch.empty_like(x)


@torch.library.custom_op("fxrt_test_py::gelu_plus_one", mutates_args=())
def gelu_plus_one(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    # Its default differs from aten::gelu's ("none") and ``approximate`` is positional here.
    _py_calls.append(f"gelu_plus_one:{approximate}")
    return torch.ops.aten.gelu.default(x, approximate=approximate) + 1


@gelu_plus_one.register_fake
def _(x, approximate="tanh"):
    return torch.empty_like(x)


def test_custom_op_in_compiled_graph(executor):
    def f(x):
        return torch.ops.fxrt_test_py.cubic(x + 1, 0.5).sum(0)

    x = torch.randn(3, 4)
    _py_calls.clear()
    got = compile_and_run(f, (x,), executor)
    assert _py_calls == ["cubic"]  # its Python kernel ran, once
    torch.testing.assert_close(got, ((x + 1) ** 3 * 0.5).sum(0))

    cg = _compile(f, (x,), executor)
    assert "fxrt_test_py::cubic(" in str(cg.program)
    torch.testing.assert_close(cg(x), f(x))


def test_override_with_a_python_callable(executor):
    seen = []

    @fxrt.register_kernel(torch.ops.aten.gelu)
    def tanh_gelu(x, *, approximate="none"):
        seen.append(approximate)
        return torch.ops.aten.gelu.default(x, approximate="tanh")

    def f(x):
        return F.gelu(x.cos()) * 3

    x = torch.randn(32)
    cg = _compile(f, (x,), executor)
    assert cg.program.fallbacks == ("gelu",) and "gelu" in _loop_fallbacks(cg)
    assert "PYCALL %gelu = " in str(cg.program) and "tanh_gelu" in str(cg.program)
    got = cg(x)
    assert seen == ["none"]
    torch.testing.assert_close(got, F.gelu(x.cos(), approximate="tanh") * 3)
    assert not torch.allclose(got, f(x))  # eager still runs the exact gelu
    assert seen == ["none"]

    seen.clear()
    via_dynamo = compile_and_run(f, (x,), executor)
    assert seen == ["none"]
    torch.testing.assert_close(via_dynamo, got)


@pytest.mark.parametrize("approximate", [None, "none", "tanh"])
def test_override_with_a_custom_op_rebinds_arguments(executor, approximate):
    fxrt.register_kernel("aten::gelu", gelu_plus_one)
    kw = {} if approximate is None else {"approximate": approximate}

    def f(x):
        return F.gelu(x, **kw)

    x = torch.randn(10)
    cg = _compile(f, (x,), executor)
    assert "fxrt_test_py::gelu_plus_one(" in str(cg.program) and _loop_fallbacks(cg) == ()
    _py_calls.clear()
    got = cg(x)
    # aten::gelu's default ("none") is passed explicitly: the replacement's default differs.
    expected_mode = approximate or "none"
    assert _py_calls == [f"gelu_plus_one:{expected_mode}"]
    torch.testing.assert_close(got, F.gelu(x, approximate=expected_mode) + 1)


def test_unregister_restores_the_aten_kernel(executor):
    fxrt.register_kernel("aten::gelu", lambda x, *, approximate="none": x * 0)
    x = torch.randn(6)
    assert torch.equal(_compile(F.gelu, (x,), executor)(x), torch.zeros(6))
    removed = fxrt.unregister_kernel(torch.ops.aten.gelu.default)
    assert removed is not None and removed.op == "aten::gelu"
    assert fxrt.unregister_kernel("aten::gelu") is None
    cg = _compile(F.gelu, (x,), executor, own_ops=False)  # not fxrt's own gelu
    assert "aten::gelu(" in str(cg.program)
    torch.testing.assert_close(cg(x), F.gelu(x))


# --- errors ---------------------------------------------------------------------------------


def test_missing_library(tmp_path):
    path = tmp_path / "libnothere.so"
    with pytest.raises(FileNotFoundError, match="libnothere.so") as info:
        fxrt.load_kernel_library(path)
    assert info.value.filename == str(path)


def test_broken_library(tmp_path):
    path = tmp_path / "libbroken.so"
    path.write_bytes(b"this is not an ELF file\n" * 10)
    with pytest.raises(OSError, match="cannot load kernel library .*libbroken.so") as info:
        fxrt.load_kernel_library(path)
    assert not isinstance(info.value, FileNotFoundError)
    assert str(info.value.__cause__) in str(info.value)  # the loader's own message is kept


def test_override_schema_mismatch(library):
    fxrt.load_kernel_library(library)
    fxrt.unregister_kernel("aten::gelu")
    with pytest.raises(ValueError, match="schema does not match") as info:
        fxrt.register_kernel("aten::gelu", "fxrt_test::scaled_add")
    msg = str(info.value)
    assert 'aten::gelu(Tensor self, *, str approximate="none") -> Tensor' in msg
    assert "fxrt_test::scaled_add(Tensor a, Tensor b, float alpha) -> Tensor" in msg
    # An in-place op is not an override for its functional form, even with equal types.
    with pytest.raises(ValueError, match="schema does not match"):
        fxrt.register_kernel("aten::relu", "aten::relu_")
    assert overrides.kernel_overrides() == {}


def test_override_errors():
    with pytest.raises(ValueError, match="not a registered op"):
        fxrt.register_kernel("aten::gelu", "nosuchlib::fast_gelu")
    with pytest.raises(ValueError, match="not an op name"):
        fxrt.register_kernel("gelu", torch.sin)
    with pytest.raises(ValueError, match="cannot be called like aten::gelu"):
        fxrt.register_kernel("aten::gelu", lambda x, mode: x)  # `approximate` is keyword-only
    with pytest.raises(TypeError, match="impl must be"):
        fxrt.register_kernel("aten::gelu", 3)
    assert overrides.kernel_overrides() == {}
