"""A registry of fused-kernel payloads, keyed by kernel name.

A device library that fuses ops into its own kernels (as torch_npu's DVM path does with
``register_dvm_op``/``get_dvm_payload``) produces, at compile time, something its runtime needs to
run each kernel: a JSON description, a compiled binary, a handle, or a ready callable. It registers
that payload here under the kernel's name; fxrt's Inductor wrapper (:mod:`fxrt.inductor.fx_wrapper`)
and the library's own kernel-definition code read it back by name:

* a payload that is callable can stand in for the kernel itself: when the host graph calls a
  non-Triton kernel that the wrapper never defined, fxrt calls the registered payload with the
  kernel's arguments (``payload(*call_args)``, the convention of Inductor's CPU kernels);
* any payload is attached to the host-graph nodes that call the kernel
  (``node.meta["fxrt_fused_payload"]``), where graph passes can read it.

The registry is process-wide and thread-safe; registering a name again replaces its payload.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_payloads: dict[str, Any] = {}


def register_fused_kernel(name: str, payload: Any) -> None:
    """Register what a device library needs to run its fused kernel ``name``.

    Args:
        name: the kernel's name, as Inductor's wrapper calls it (``KernelCallLine.kernel_name``).
        payload: anything the library needs at run time; a callable payload is called as the
            kernel when the wrapper has no definition for ``name``.

    Raises:
        TypeError: ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"fxrt: a fused kernel's name must be a non-empty string, got {name!r}")
    with _lock:
        _payloads[name] = payload


def get_fused_kernel_payload(name: str) -> Any | None:
    """The payload registered for the fused kernel ``name``, or None if there is none."""
    with _lock:
        return _payloads.get(name)


def unregister_fused_kernel(name: str) -> None:
    """Forget ``name``'s payload (no error if it has none)."""
    with _lock:
        _payloads.pop(name, None)


__all__ = ["get_fused_kernel_payload", "register_fused_kernel", "unregister_fused_kernel"]
