"""The DispatchStub macros of the installed torch, found by linking a probe (setup.py uses this
module, loaded by its path; csrc/cmake/cpu_stubs.cmake does the same in CMake).

fxrt's own ops (``own_ops.h``) call ATen's CPU kernels through their DispatchStubs, whose
declarations depend on the CPU capabilities torch was built with (``HAVE_AVX512_CPU_DEFINITION``
and ``HAVE_AVX2_CPU_DEFINITION`` on x86-64, ``HAVE_SVE_CPU_DEFINITION`` on aarch64, ...): macros
torch's build sets and its headers do not record. ``cpu_stubs_probe.cpp`` calls two stubs and links
only when compiled with the macros torch was built with (the symbols it needs are named after
them), so each known set is tried, the likely one first. The one that links is defined with
``FXRT_CPU_STUBS``; when none does, the own ops call the ATen ops instead of the kernels. Importing
this module imports nothing outside the standard library.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_stubs_probe.cpp")

CANDIDATES: tuple[tuple[str, ...], ...] = (
    ("HAVE_AVX512_CPU_DEFINITION", "HAVE_AVX2_CPU_DEFINITION"),
    ("HAVE_SVE_CPU_DEFINITION",),
    ("HAVE_AVX2_CPU_DEFINITION",),
    ("HAVE_VSX_CPU_DEFINITION",),
    ("HAVE_ZVECTOR_CPU_DEFINITION",),
    (),
)


def candidates(machine: str | None = None) -> list[tuple[str, ...]]:
    """The known macro sets, the likely one for ``machine`` (default: this one) first."""
    out = list(CANDIDATES)
    if (machine or platform.machine()).lower() in ("aarch64", "arm64"):
        out.insert(0, out.pop(1))
    return out


def links(
    defs: Sequence[str],
    include_dirs: Sequence[str],
    library_dirs: Sequence[str],
    abi: int,
    cxx: Sequence[str] | None = None,
) -> bool:
    """Whether the probe compiles and links against torch with the macros ``defs``."""
    cxx = list(cxx or os.environ.get("CXX", "c++").split())
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            *cxx,
            "-std=c++20",
            "-O0",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *[f"-D{d}=1" for d in defs],
            *[f"-I{d}" for d in include_dirs],
            PROBE,
            "-o",
            os.path.join(tmp, "probe"),
            *[f"-L{d}" for d in library_dirs],
            "-ltorch_cpu",
            "-lc10",
        ]
        return subprocess.run(cmd, capture_output=True).returncode == 0


def stub_macros(
    include_dirs: Sequence[str], library_dirs: Sequence[str], abi: int
) -> list[tuple[str, str]]:
    """The define_macros for the extension: the set that links and FXRT_CPU_STUBS, or none
    (no compiler, or no known set links)."""
    cxx = os.environ.get("CXX", "c++").split()
    if not os.path.exists(PROBE) or shutil.which(cxx[0]) is None:
        return []
    for defs in candidates():
        if links(defs, include_dirs, library_dirs, abi, cxx):
            return [(d, "1") for d in defs] + [("FXRT_CPU_STUBS", "1")]
    return []


__all__ = ["CANDIDATES", "PROBE", "candidates", "links", "stub_macros"]
