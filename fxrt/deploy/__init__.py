"""Deploy without Dynamo: ``fxrt.export`` a model to a package file, ``fxrt.load`` it elsewhere.

    pkg = fxrt.export(model, args, kwargs, dynamic_shapes=..., options=...)
    pkg.save("model.fxrt")
    m = fxrt.load("model.fxrt")          # a callable with the model's signature
    python -m fxrt inspect model.fxrt    # signature, ranges, ops, fallbacks, weights, versions

Modules: :mod:`.build` (export: trace, decompose, compile, package), :mod:`.loaded` (load),
:mod:`.runtime_model` (``LoadedModel``, the face over the C++ runtime that loads, checks and runs
packages), :mod:`.host_loop` (the package's graph on fxrt's own loops, where the runtime's loop
does not run a call), :mod:`.signature` (the calling convention), :mod:`.binder` (the call's
structure), :mod:`.program_data` (the stored program), :mod:`.package` (the file layout and
manifest), :mod:`.tensorfile` (the safetensors weights section), :mod:`.inspect` (the CLI's
text). Names resolve lazily so that the CLI can read a package's manifest without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "export": ".build",
    "Package": ".build",
    "load": ".loaded",
    "LoadedModel": ".loaded",
    "PackageError": ".package",
}
__all__ = ["LoadedModel", "Package", "PackageError", "export", "load"]
assert set(__all__) == set(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fxrt.deploy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .build import Package, export
    from .loaded import LoadedModel, load
    from .package import PackageError
