"""fxrt: a fast graph runtime for PyTorch inference.

Use it as a ``torch.compile`` backend::

    compiled = torch.compile(model, backend="fxrt")

or compile an ATen-level FX graph directly with :func:`compile_graph`, or deploy without Dynamo:
``fxrt.export(model, args).save("model.fxrt")`` and ``fxrt.load("model.fxrt")``.

The public names are imported on first use, each with only its own module: ``python -m fxrt
cache list`` answers without importing torch, and ``fxrt.load`` imports what a load runs, not
the torch.compile backend, Inductor's glue or the export side.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "backend": ".backend",
    "CompiledGraph": ".compiler",
    "compile_graph": ".compiler",
    "get_compiler": ".compiler",
    "CompilerConfig": ".config",
    "ExecutionError": ".errors",
    "InputError": ".exec.inputs",
    "export": ".deploy",
    "load": ".deploy",
    "PackageError": ".deploy",
    "get_fused_kernel_payload": ".inductor",
    "register_fused_kernel": ".inductor",
    "register_fx_wrapper": ".inductor",
    "unregister_fx_wrapper": ".inductor",
    "load_kernel_library": ".ops.overrides",
    "register_kernel": ".ops.overrides",
    "unregister_kernel": ".ops.overrides",
    "register_pattern": ".patterns",
    "unregister_pattern": ".patterns",
    "pattern_counts": ".patterns",
    "Profile": ".profiler",
    "profile": ".profiler",
    "runtime_info": ".runtime",
    "stream_scope": ".ops.streams",
    "record": ".ops.streams",
    "wait": ".ops.streams",
}

__all__ = [
    "CompiledGraph",
    "CompilerConfig",
    "ExecutionError",
    "InputError",
    "PackageError",
    "Profile",
    "backend",
    "compile_graph",
    "export",
    "get_compiler",
    "load",
    "profile",
    "record",
    "get_fused_kernel_payload",
    "load_kernel_library",
    "register_kernel",
    "register_pattern",
    "pattern_counts",
    "register_fused_kernel",
    "register_fx_wrapper",
    "runtime_info",
    "stream_scope",
    "unregister_fx_wrapper",
    "unregister_kernel",
    "unregister_pattern",
    "wait",
    "__version__",
]
assert set(__all__) == {*_PUBLIC, "__version__"}


class _Package(types.ModuleType):
    """The package's module type: importing the submodule ``fxrt.backend`` (how torch finds the
    backend by name) must not rebind the public ``fxrt.backend``, which is the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "backend" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)  # a submodule: fxrt.cache
    except ModuleNotFoundError:
        raise AttributeError(f"module 'fxrt' has no attribute {name!r}") from None


if TYPE_CHECKING:
    from .backend import backend
    from .compiler import CompiledGraph, compile_graph, get_compiler
    from .config import CompilerConfig
    from .deploy import PackageError, export, load
    from .errors import ExecutionError
    from .exec.inputs import InputError
    from .inductor import (
        get_fused_kernel_payload,
        register_fused_kernel,
        register_fx_wrapper,
        unregister_fx_wrapper,
    )
    from .ops.overrides import load_kernel_library, register_kernel, unregister_kernel
    from .ops.streams import record, stream_scope, wait
    from .patterns import pattern_counts, register_pattern, unregister_pattern
    from .profiler import Profile, profile
    from .runtime import runtime_info
