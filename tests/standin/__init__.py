"""fxrt's stand-in accelerator for tests: a PrivateUse1 device on host memory with asynchronous
streams (see ``standin.cpp`` for how it works).

``load()`` builds the C++ extension on first use (one translation unit, about 30 s; cached under
``$XDG_CACHE_HOME/fxrt-test-build/<key>`` or the temporary directory, keyed by the source, torch
and Python), loads it, names the PrivateUse1 backend (``fxrt_standin`` unless told otherwise, or
``$FXRT_STANDIN_NAME``), registers :mod:`standin.device` as ``torch.<name>`` and generates the
``Tensor.<name>()`` methods. A process can name the backend once; the name is fixed from then on.

    import standin
    dev = standin.load()                  # the device module, also torch.fxrt_standin
    x = torch.randn(4, device="fxrt_standin")
    dev.set_delay_us(2000)                # side streams lag 2 ms per task
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("standin.cpp")
EXT_NAME = "fxrt_standin_ext"
DEFAULT_NAME = "fxrt_standin"

_BUILD = (
    "import sys\n"
    "from torch.utils.cpp_extension import load\n"
    "load(sys.argv[1], [sys.argv[2]], build_directory=sys.argv[3], is_python_module=True,"
    " extra_cflags=['-O1'])\n"
)


class Unavailable(RuntimeError):
    """The stand-in cannot be built here (no C++ compiler); tests skip with this reason."""


def _build_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or tempfile.gettempdir()
    key = hashlib.sha256(
        SOURCE.read_bytes() + f"\0{torch.__version__}\0{sys.version}".encode()
    ).hexdigest()[:16]
    return Path(base) / "fxrt-test-build" / f"standin-{key}"


def build() -> Path:
    """The extension's path, built if the cache lacks it (not loaded here).

    Raises:
        Unavailable: no C++ compiler.
        RuntimeError: the build failed (with the compiler's output).
    """
    out = _build_dir()
    so = out / f"{EXT_NAME}.so"
    if so.exists():
        return so
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise Unavailable("no C++ compiler to build the stand-in device")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test processes build it once
        if so.exists():
            return so
        work = Path(tempfile.mkdtemp(prefix="build-", dir=out))
        try:
            src = work / SOURCE.name
            shutil.copyfile(SOURCE, src)
            proc = subprocess.run(
                [sys.executable, "-c", _BUILD, EXT_NAME, str(src), str(work)],
                capture_output=True,
                text=True,
                timeout=900,
            )
            built = work / f"{EXT_NAME}.so"
            if proc.returncode != 0 or not built.exists():
                raise RuntimeError(
                    f"building the stand-in device failed:\n{proc.stdout}\n{proc.stderr}"
                )
            os.replace(built, so)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return so


_C: ModuleType | None = None


def extension() -> ModuleType:
    """The loaded C++ module (built and loaded on first call; registers the backend's kernels,
    guard, hooks and allocator with PyTorch)."""
    global _C
    if _C is None:
        so = build()
        spec = importlib.util.spec_from_file_location(EXT_NAME, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _C = module
        atexit.register(_shutdown)
    return _C


def _shutdown() -> None:
    # Let every stream finish before the interpreter goes away under a task that needs it.
    with contextlib.suppress(Exception):
        _C.synchronize_all()


def load(name: str | None = None) -> ModuleType:
    """Build, load and register the stand-in; return its device module (``torch.<name>``).

    Args:
        name: the PrivateUse1 backend's name (default ``$FXRT_STANDIN_NAME`` or
            ``fxrt_standin``). ``"npu"`` makes it look like ``torch_npu``'s device, which only a
            process without ``torch_npu`` may do.
    """
    name = name or os.environ.get("FXRT_STANDIN_NAME") or DEFAULT_NAME
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", name):
        raise RuntimeError(
            f"this process's PrivateUse1 backend is already named {current!r}, not {name!r}"
        )
    extension()
    from . import device

    if current != name:
        torch.utils.rename_privateuse1_backend(name)
    if getattr(torch, name, None) is not device:
        torch._register_device_module(name, device)
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    device.name = name
    return device


def name() -> str:
    """The backend's name in this process (after :func:`load`)."""
    return torch._C._get_privateuse1_backend_name()


__all__ = ["DEFAULT_NAME", "Unavailable", "build", "extension", "load", "name"]
