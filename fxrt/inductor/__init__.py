"""fxrt as Inductor's host-wrapper executor (``torch._inductor.config.fx_wrapper``).

:func:`register_fx_wrapper` makes ``torch.compile``'s default Inductor backend hand its host code,
as an FX graph, to fxrt; :func:`register_fused_kernel` lets a device library attach what its own
fused kernels need to run. The implementation is in :mod:`fxrt.inductor.fx_wrapper`; it imports
Inductor's codegen (seconds), so this package loads it only when a registration function runs and
``import fxrt`` stays cheap.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from .fused_kernels import get_fused_kernel_payload, register_fused_kernel, unregister_fused_kernel
from .host_graph import capturing_modules, compiled_host_graphs, stats

if TYPE_CHECKING:
    from ..config import CompilerConfig

_IMPL = __name__ + ".fx_wrapper"


def register_fx_wrapper(config: CompilerConfig | None = None) -> None:
    """Make Inductor emit its host wrapper as an FX graph and run it with fxrt.

    Sets ``torch._inductor.config.fx_wrapper = True`` and installs fxrt's wrapper codegen (a
    ``WrapperFxCodegen`` subclass) for Inductor's cpu and cuda backends. Graphs Inductor compiles
    afterwards keep their generated non-Triton kernels (C++ CPU kernels, device-library fused
    kernels) as calls in the host graph, and fxrt executes that graph; Triton kernels go through
    the upstream conversion. Idempotent: calling it again only replaces ``config``.

    Args:
        config: fxrt options for the host graphs (``pure_python=True`` picks the Python loop).
            Defaults to ``CompilerConfig()``.
    """
    from .fx_wrapper import register_fx_wrapper as register

    register(config)


def unregister_fx_wrapper() -> None:
    """Undo :func:`register_fx_wrapper`: restore Inductor's wrapper codegen registrations and the
    ``fx_wrapper`` config value exactly as they were. Idempotent; a no-op when not registered."""
    impl = sys.modules.get(_IMPL)
    if impl is not None:  # never registered if never imported
        impl.unregister_fx_wrapper()


def is_registered() -> bool:
    """Whether :func:`register_fx_wrapper` is in effect."""
    impl = sys.modules.get(_IMPL)
    return impl is not None and impl.is_registered()


def __getattr__(name: str) -> Any:
    if name in ("FxrtWrapperCodegen", "HostGraphConverter"):
        from . import fx_wrapper

        return getattr(fx_wrapper, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FxrtWrapperCodegen",
    "capturing_modules",
    "compiled_host_graphs",
    "get_fused_kernel_payload",
    "is_registered",
    "register_fused_kernel",
    "register_fx_wrapper",
    "stats",
    "unregister_fused_kernel",
    "unregister_fx_wrapper",
]
