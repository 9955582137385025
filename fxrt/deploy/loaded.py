"""``fxrt.load``: a package file to a callable model, without Dynamo or compiling.

fxrt's C++ runtime (:mod:`.runtime_model`, the library the C++ API ships) loads every package and
makes every call's checks: one loader, one set of input checks, one idea of a valid package for
Python and C++. Where its loop does not run a call (the Python loop, a program with nodes that
run Python or several streams, a profiler), it runs the package's graph on fxrt's own loops in
its place (:mod:`.host_loop`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ..exec.inputs import InputError
from .runtime_model import RUNTIME_OPTIONS, LoadedModel, load_runtime


def load(
    path: str | os.PathLike[str] | bytes | bytearray | memoryview,
    device: str | torch.device | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    verify_weights: bool = True,
) -> LoadedModel:
    """Load a package written by ``fxrt.export(...).save(path)``.

    Args:
        path: the file (memory-mapped), or its bytes.
        device: where the weights go and the graph runs (default: the export's device).
        options: runtime options overriding the package's: ``pure_python``, ``arena``,
            ``arena_max_idle``, ``check_inputs``.
        verify_weights: check the SHA-256 of the weight bytes (reads them all once); the
            structure's hash and the validation run regardless.

    Returns:
        A :class:`fxrt.deploy.LoadedModel`, called like the exported model.

    Raises:
        PackageError: not a valid package, damaged, or not runnable in this process (an op whose
            schema changed, an output type that is not registered); the message says which.
        ValueError: an unknown option.
        RuntimeError: fxrt's C++ extension is not built.
    """
    bad = sorted(set(options or {}) - set(RUNTIME_OPTIONS))
    if bad:
        raise ValueError(f"fxrt.load: unknown option(s) {bad}; valid: {', '.join(RUNTIME_OPTIONS)}")
    binary = isinstance(path, (bytes, bytearray, memoryview))
    source = path if binary else os.fspath(path)
    where = "<bytes>" if binary else source
    return load_runtime(source, where, device, verify_weights, dict(options or {}))


__all__ = ["InputError", "LoadedModel", "load"]
