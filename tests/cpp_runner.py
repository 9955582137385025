"""Builds ``examples/cpp_runner`` (and the C++ runtime, ``csrc/``) for the tests, once per source
tree and torch: CMake and the C++ compiler, against the libtorch of the installed torch wheel.

The build directory is cached under ``$XDG_CACHE_HOME`` (or the temporary directory), keyed by
the sources (the runtime, the compiled loop's headers, the runner) and the torch version, so the
suite pays for it (about two minutes on two cores) only when one of them changes. Concurrent test
processes build it once (a file lock). The build tree is kept: :func:`install` installs the
runtime from it (``cmake --install``) and :func:`build_consumer` builds the runner again against
that installed package.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    *sorted((ROOT / "csrc").rglob("*")),
    *sorted((ROOT / "fxrt" / "_speedups").glob("*.h")),
    ROOT / "fxrt" / "_speedups" / "cpu_stubs_probe.cpp",
    *sorted((ROOT / "examples" / "cpp_runner").glob("*")),
]


class Unavailable(RuntimeError):
    """No CMake or C++ compiler here; the C++ tests skip with this reason."""


def _key() -> str:
    h = hashlib.sha256(torch.__version__.encode())
    for p in SOURCES:
        if p.is_file():
            h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


_built: Path | None = None  # this process's runner: the sources it was keyed on


def build() -> Path:
    """The runner binary, built if the cache lacks it.

    Raises:
        Unavailable: no cmake or no C++ compiler.
        RuntimeError: the build failed (with its output).
    """
    global _built
    if _built is None or not _built.exists():
        _built = _build()
    return _built


def _tools() -> str:
    cmake = shutil.which("cmake")
    if cmake is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        raise Unavailable("no cmake or C++ compiler to build examples/cpp_runner")
    return cmake


def _run_steps(steps: list[list[str]], what: str) -> None:
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{what} failed ({' '.join(cmd)}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )


def _jobs() -> str:
    return str(min(os.cpu_count() or 1, 4))


def _build() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or tempfile.gettempdir())
    out = base / "fxrt-test-build" / f"cpp-runner-{_key()}"
    exe = out / "fxrt_runner"
    if exe.exists():
        return exe
    _tools()  # raises without the toolchain, before anything is written
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.exists():
            return exe
        work = out / "build"  # kept for install(); a build that failed halfway resumes here
        _build_runner(work, [f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"])
        shutil.copy2(work / "fxrt_runner", out / "fxrt_runner.tmp")
        os.replace(out / "fxrt_runner.tmp", exe)
    return exe


def build_dir() -> Path:
    """The runner's CMake build tree (which builds the runtime with add_subdirectory)."""
    return build().parent / "build"


def install(prefix: Path) -> None:
    """``cmake --install`` the runtime built for the runner into ``prefix``."""
    _run_steps([[_tools(), "--install", str(build_dir()), "--prefix", str(prefix)]], "install")


def build_consumer(prefix: Path, work: Path) -> Path:
    """The runner built again, against the runtime installed in ``prefix``
    (``find_package(fxrt CONFIG REQUIRED)``, ``-DFXRT_RUNNER_INSTALLED=ON``); its binary."""
    _build_runner(
        work,
        ["-DFXRT_RUNNER_INSTALLED=ON", f"-DCMAKE_PREFIX_PATH={prefix}"],
        "against the installed runtime",
    )
    return work / "fxrt_runner"


def _build_runner(work: Path, defs: list[str], what: str = "") -> None:
    """Configure examples/cpp_runner in ``work`` with ``defs`` (Release) and build it."""
    cmake = _tools()
    _run_steps(
        [
            [cmake, "-S", str(ROOT / "examples" / "cpp_runner"), "-B", str(work), *defs]
            + ["-DCMAKE_BUILD_TYPE=Release"],
            [cmake, "--build", str(work), "-j", _jobs()],
        ],
        " ".join(filter(None, ["building examples/cpp_runner", what])),
    )


def configure(source: Path, work: Path, *defs: str) -> subprocess.CompletedProcess[str]:
    """CMake's configure step alone for the project at ``source`` (torch on the prefix path)."""
    return subprocess.run(
        [
            _tools(),
            "-S",
            str(source),
            "-B",
            str(work),
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            *defs,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the runner (built first if needed) with ``args``."""
    return subprocess.run([str(build()), *args], capture_output=True, text=True, timeout=timeout)


if __name__ == "__main__":  # `make test`'s set-up step: the build, before the suite's clock starts
    try:
        print(f"==> the C++ runtime and examples/cpp_runner: {build()}")
    except Unavailable as e:  # the C++ tests skip with this reason; nothing else needs them
        print(f"==> the C++ runtime is not built ({e}): tests/test_deploy_cpp.py will skip")
