"""Shared helpers: compile a callable with fxrt on each loop, check which loop ran, compare."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._functorch.config

import fxrt

# Tests never read or write the user's compile cache.
os.environ.setdefault("FXRT_CACHE_DIR", tempfile.mkdtemp(prefix="fxrt-test-cache-"))

# AOTAutograd checks the custom ops a compiled function calls on its first call; a custom op
# whose result aliases an input without saying so in its schema is an error wherever ``CI`` is
# set, and a warning elsewhere. Tests treat it as an error everywhere.
torch._functorch.config.error_on_custom_op_aliasing = True


def build_ext_skipped() -> bool:
    """Whether ``FXRT_BUILD_EXT=0`` (or false/no/off) is set: fxrt installed without its C++
    extension on purpose, as setup.py reads the variable."""
    return os.environ.get("FXRT_BUILD_EXT", "1").strip().lower() in {"0", "false", "no", "off"}


def compiled_loop_problem(info: dict[str, Any], skipped_on_purpose: bool) -> str | None:
    """Why this session must not run, given ``fxrt.runtime_info()``: the compiled loop is missing
    (or a default compile would not pick it) and nobody chose that with ``FXRT_BUILD_EXT=0``.
    Without this check a missing extension only skips the compiled-loop tests and the suite
    passes on the Python loop alone."""
    if skipped_on_purpose:
        return None
    if not info["native_available"]:
        return f"the compiled loop is not available: {info['reason']}"
    if info["executor"] != "cpp" and not info["pure_python"]:
        return f"default compiles run on the {info['executor']} loop: {info['reason']}"
    return None


def pytest_sessionstart(session) -> None:
    # ``make test`` runs two workers (pytest-xdist) on this project's two cores: each worker keeps
    # to one intra-op thread, or the two processes' thread pools contend for both cores.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        # The suite's time is mostly Dynamo's traces, which allocate millions of short-lived
        # objects: collections of the youngest generation every 700 allocations, and full ones
        # that walk torch's modules, are about 6% of it. Objects alive now (the imports) are left
        # out of collections, and the youngest generation collected every 50,000 allocations.
        gc.collect()
        gc.freeze()
        gc.set_threshold(50_000, 20, 50)
    problem = compiled_loop_problem(fxrt.runtime_info(), build_ext_skipped())
    if problem:
        pytest.exit(
            f"fxrt: {problem}. Build it (`make .venv/.fxrt`, or `pip install "
            "--no-build-isolation -e .`), or set FXRT_BUILD_EXT=0 to test the Python loop alone "
            "on purpose.",
            returncode=pytest.ExitCode.TESTS_FAILED,
        )


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """Installed without the C++ extension on purpose (``FXRT_BUILD_EXT=0``), a test that loads a
    package skips when it calls ``fxrt.load``, which runs on the extension's C++ runtime."""
    from fxrt.deploy.runtime_model import RuntimeNotBuilt

    try:
        return (yield)
    except RuntimeNotBuilt as e:
        if not build_ext_skipped():
            raise
        pytest.skip(f"fxrt.load: {str(e)[:200]}")


def pytest_collection_modifyitems(session, config, items) -> None:
    # Autograd's engine sizes its per-device queues once, at the first backward of the process,
    # from the devices registered then: load the stand-in before any test runs if one needs it.
    if any("dev" in getattr(item, "fixturenames", ()) for item in items):
        import standin

        with contextlib.suppress(standin.Unavailable):
            standin.load()


def native_available() -> bool:
    info = getattr(fxrt, "runtime_info", None)
    return bool(info and info().get("native_available"))


EXECUTORS = ["python", "cpp"]


@contextlib.contextmanager
def recording_compiles():
    """Collect every CompiledGraph fxrt builds (or loads from its cache) inside the block."""
    built: list[fxrt.CompiledGraph] = []
    original = fxrt.CompiledGraph.__init__

    def spy(self: fxrt.CompiledGraph, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        built.append(self)

    fxrt.CompiledGraph.__init__ = spy
    try:
        yield built
    finally:
        fxrt.CompiledGraph.__init__ = original


def skip_unless_executor(executor: str) -> None:
    if executor == "cpp" and not native_available():
        pytest.skip("the compiled loop (fxrt._speedups) is not built")


def compile_and_run(fn: Callable, inputs: tuple, executor: str, **compile_kwargs: Any) -> Any:
    """torch.compile ``fn`` with fxrt on ``executor`` and call it; assert that loop ran."""
    skip_unless_executor(executor)
    torch._dynamo.reset()
    options = {**compile_kwargs.pop("options", {}), "pure_python": executor == "python"}
    with recording_compiles() as built:
        compiled = torch.compile(fn, backend="fxrt", options=options, **compile_kwargs)
        out = compiled(*inputs)
    assert built, "fxrt compiled no graph"
    assert {cg.executor for cg in built} == {executor}
    return out


def check_against_eager(model: Callable, inputs: tuple, executor: str, **kw: Any) -> Any:
    """Run a fresh copy of ``model`` eagerly and compiled; outputs and mutated state must match."""
    eager_model = copy.deepcopy(model)
    compiled_model = copy.deepcopy(model)
    eager_inputs = copy.deepcopy(inputs)
    expected = eager_model(*eager_inputs)
    got = compile_and_run(compiled_model, inputs, executor, **kw)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(inputs, eager_inputs)  # input mutations match too
    if isinstance(model, torch.nn.Module):
        torch.testing.assert_close(compiled_model.state_dict(), eager_model.state_dict())
    return got


def run_in_threads(work: Callable[[int], None], n: int = 8) -> None:
    """Run ``work(seed)`` for seeds 0..n-1 in n threads at once; raise the first failure."""
    failures: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            work(seed)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


class LoggingDispatchMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher's Python mode."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class RecordingFunctionMode(torch.overrides.TorchFunctionMode):
    """Records the name of every function ``__torch_function__`` sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class LoggingTensor(torch.Tensor):
    """A subclass whose ``__torch_function__`` records what it sees (in ``seen``)."""

    seen: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(str(func))
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.fixture(params=EXECUTORS)
def executor(request) -> str:
    return request.param


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "wrapper_fallback: the test expects Inductor graphs on Inductor's own wrapper"
    )


@pytest.fixture(autouse=True)
def _no_wrapper_fallback(request):
    """A graph that left fxrt for Inductor's own Python wrapper (fxrt.inductor's one warning
    line) fails the test that compiled it, unless it is marked ``wrapper_fallback``: the suite
    checks that every wrapper Inductor emits for its models runs on fxrt."""
    from fxrt.inductor import stats

    before = stats["python_wrapper_fallbacks"]
    yield
    if request.node.get_closest_marker("wrapper_fallback") is None:
        fell_back = stats["python_wrapper_fallbacks"] - before
        assert not fell_back, f"{fell_back} Inductor graph(s) ran on Inductor's own wrapper"


def _register_hypothesis_profiles() -> None:
    import os

    from hypothesis import HealthCheck, settings

    common = dict(
        deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
    )
    settings.register_profile("ci", max_examples=600, derandomize=True, **common)
    settings.register_profile("thorough", max_examples=10_000, **common)
    settings.register_profile("dev", max_examples=50, **common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_register_hypothesis_profiles()


def pytest_sessionfinish(session, exitstatus) -> None:
    """With ``FXRT_STATS_FILE`` set (the warm tier's child runs), write the cache's counters."""
    path = os.environ.get("FXRT_STATS_FILE")
    if path:
        import json

        with open(path, "w") as f:
            json.dump(dict(fxrt.cache.stats), f)


@pytest.fixture(scope="module")
def dev():
    """The stand-in accelerator's device module (tests/standin, built on first use), or a skip
    that says why it cannot be built here."""
    import standin

    try:
        return standin.load()
    except standin.Unavailable as e:
        pytest.skip(str(e))


def run_child(script: str, cache_dir, executor: str, *args: str, env: dict | None = None) -> dict:
    """Run ``script`` in a fresh process on ``cache_dir``; return the JSON its last line prints."""
    environ = {
        **os.environ,
        "FXRT_CACHE_DIR": str(cache_dir),
        "FXRT_PURE_PYTHON": "1" if executor == "python" else "0",
        **(env or {}),
    }
    path = os.path.join(tempfile.mkdtemp(), "child.py")  # a file: Dynamo records source lines
    with open(path, "w") as f:
        f.write(textwrap.dedent(script))
    out = subprocess.run(
        [sys.executable, path, *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
