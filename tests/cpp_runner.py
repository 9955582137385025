"""Builds ``examples/cpp_runner`` (and the C++ runtime, ``csrc/``) for the tests, once per source
tree and torch: CMake and the C++ compiler, against the libtorch of the installed torch wheel.

The build directory is cached under ``$XDG_CACHE_HOME`` (or the temporary directory), keyed by
the sources (the runtime, the compiled loop's headers, the runner) and the torch version, so the
suite pays for it (about two minutes on two cores) only when one of them changes. Concurrent test
processes build it once (a file lock).
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


def _build() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or tempfile.gettempdir())
    out = base / "fxrt-test-build" / f"cpp-runner-{_key()}"
    exe = out / "fxrt_runner"
    if exe.exists():
        return exe
    cmake = shutil.which("cmake")
    if cmake is None or shutil.which(os.environ.get("CXX", "c++")) is None:
        raise Unavailable("no cmake or C++ compiler to build examples/cpp_runner")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.exists():
            return exe
        work = Path(tempfile.mkdtemp(prefix="build-", dir=out))
        try:
            steps = [
                [
                    cmake,
                    "-S",
                    str(ROOT / "examples" / "cpp_runner"),
                    "-B",
                    str(work),
                    f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                    "-DCMAKE_BUILD_TYPE=Release",
                ],
                [cmake, "--build", str(work), "-j", str(min(os.cpu_count() or 1, 4))],
            ]
            for cmd in steps:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0:
                    raise RuntimeError(
                        f"building examples/cpp_runner failed ({' '.join(cmd)}):\n"
                        f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
                    )
            os.replace(work / "fxrt_runner", exe)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return exe


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the runner (built first if needed) with ``args``."""
    return subprocess.run([str(build()), *args], capture_output=True, text=True, timeout=timeout)
