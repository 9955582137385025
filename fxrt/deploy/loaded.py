"""``fxrt.load``: a package file to a callable model, without Dynamo or compiling.

The C++ runtime (:mod:`.runtime_model`, the library the C++ API ships) loads and runs the package:
one loader, one set of input checks, one idea of a valid package for Python and C++. The Python
loader (:mod:`.python_loader`) runs it where the runtime does not: with the Python loop
(``pure_python``), with a ``check_inputs`` option or an arena the stored program lacks (the
program lowered again), without the extension, and for packages the runtime cannot run (no
stored program, several streams, a node that runs Python). ``arena=False`` and
``arena_max_idle`` the runtime honours itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ..exec.inputs import InputError
from .python_loader import RUNTIME_OPTIONS, PythonLoadedModel, load_python
from .runtime_model import LoadedModel, load_runtime

LoadedModel.register(PythonLoadedModel)  # isinstance(m, LoadedModel) holds for both


def load(
    path: str | os.PathLike[str] | bytes | bytearray | memoryview,
    device: str | torch.device | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    verify_weights: bool = True,
) -> Any:
    """Load a package written by ``fxrt.export(...).save(path)``.

    Args:
        path: the file (memory-mapped), or its bytes.
        device: where the weights go and the graph runs (default: the export's device).
        options: runtime options overriding the package's: ``pure_python``, ``arena``,
            ``arena_max_idle``, ``check_inputs``.
        verify_weights: check the SHA-256 of the weight bytes (reads them all once); the
            structure's hash and the validation run regardless.

    Returns:
        A :class:`fxrt.deploy.LoadedModel` (the C++ runtime's), or with the Python loop, or for
        a package the runtime does not run, a :class:`PythonLoadedModel`; either is called like
        the exported model.

    Raises:
        PackageError: not a valid package, damaged, or not runnable in this process (an op whose
            schema changed, an output type that is not registered); the message says which.
        ValueError: an unknown option.
    """
    bad = sorted(set(options or {}) - set(RUNTIME_OPTIONS))
    if bad:
        raise ValueError(f"fxrt.load: unknown option(s) {bad}; valid: {', '.join(RUNTIME_OPTIONS)}")
    options = dict(options or {})
    # The C++ runtime loads and runs the package, unless the Python loop is asked for or an
    # option would lower the program again (the runtime runs the stored one).
    binary = isinstance(path, (bytes, bytearray, memoryview))
    source = path if binary else os.fspath(path)
    where = "<bytes>" if binary else source
    model = load_runtime(source, where, device, verify_weights, options)
    if model is not None:
        return model
    return load_python(path, device, options=options, verify_weights=verify_weights)


__all__ = ["InputError", "LoadedModel", "PythonLoadedModel", "load", "load_python"]
