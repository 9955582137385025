"""``runtime_info()``: which loop fxrt runs compiled graphs with, and why."""

from __future__ import annotations

from typing import Any

import torch

from .config import CompilerConfig
from .exec.native import extension_status


def runtime_info() -> dict[str, Any]:
    """Describe the executor a default-configured compile would use.

    Returns:
        A dict with ``executor`` (``"cpp"`` or ``"python"``), ``reason`` (why), ``extension_path``
        (the compiled loop's file, or None if it did not import), ``extension_torch_version``
        (the torch it was built against, or None), ``torch_version`` (the running torch),
        ``native_available`` (the compiled loop can run) and ``pure_python`` (the
        ``FXRT_PURE_PYTHON`` setting).
    """
    status = extension_status()
    pure_python = CompilerConfig().pure_python
    if pure_python:
        executor, reason = "python", "FXRT_PURE_PYTHON=1"
    elif status.usable:
        executor, reason = "cpp", status.reason
    elif _build_skipped() and status.path is None:
        executor, reason = "python", "FXRT_BUILD_EXT=0: installed without the C++ extension"
    else:
        executor, reason = "python", status.reason
    return {
        "executor": executor,
        "reason": reason,
        "extension_path": status.path,
        "extension_torch_version": status.built_torch,
        "torch_version": torch.__version__,
        "native_available": status.usable,
        "pure_python": pure_python,
    }


def _build_skipped() -> bool:
    from . import _speedups

    return _speedups.build_skipped()


__all__ = ["runtime_info"]
