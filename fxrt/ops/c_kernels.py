"""C kernels: functions compiled ahead of time that the compiled loop calls directly.

Inductor compiles each of its CPU kernels into a shared library that exports
``extern "C" void kernel(...)``, whose parameters are data pointers (``const float*``,
``float*``...) and integer sizes (``const int64_t``), and it loads the library as a Python module
whose ``kernel`` binding reads the data pointers of the tensors it is given. A :class:`CKernel`
wraps that binding (what a call through Python, the Python loop and ``__torch_function__`` run)
together with the C function's address and what each parameter is, so that the compiled loop can
call the function itself with the registers' data pointers and integers: a KERNEL instruction
(``fxrt/exec/program.py``), with no Python objects made per call.

On x86-64 and AArch64 a data pointer and an ``int64_t`` are passed alike (the same integer
registers, then the same 8-byte stack slots), so the loop calls every such function through one
signature per arity. A function with any other parameter type (``float``, which travels in a
floating-point register) has no address here and stays a Python call.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable, Sequence
from typing import Any

POINTER, INT = "ptr", "int"

# Parameter types passed as an integer register or 8-byte stack slot, besides pointers.
_INT_TYPES = frozenset({"int64_t", "long", "long int", "uintptr_t"})
MAX_ARGS = 64  # the most parameters the compiled loop calls natively (fxrt/_speedups/c_kernel.h)


def direct_calls_supported() -> bool:
    """Whether this machine's calling convention passes pointers and int64 alike."""
    return platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")


def param_kinds(arg_types: Sequence[Any]) -> tuple[str, ...] | None:
    """Each parameter's kind from its C type (``"const float*"``, ``"const int64_t"``), or None
    when one is neither a pointer nor a 64-bit integer."""
    kinds = []
    for t in arg_types:
        text = " ".join(str(t).replace("const ", " ").split())
        if text.endswith("*"):
            kinds.append(POINTER)
        elif text in _INT_TYPES:
            kinds.append(INT)
        else:
            return None
    return tuple(kinds)


def _address(binding: Any, symbol: str) -> int | None:
    """The address of ``symbol`` in the shared library that defines the Python module of
    ``binding``, already loaded in this process (never loaded anew)."""
    module = getattr(binding, "__self__", None)
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not path.endswith(".so"):
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


class CKernel:
    """A compiled C function ``symbol`` and its Python binding ``binding`` (same arguments: a
    tensor for each pointer parameter, an int for each integer one).

    Attributes:
        name: the kernel's name in the graph.
        binding: the Python callable; calling a CKernel calls it.
        params: ``"ptr"`` or ``"int"`` per parameter.
        address: the C function's address, or None when the compiled loop cannot call it
            (parameter types other than pointers and int64, or a library it cannot find).
    """

    def __init__(self, name: str, binding: Callable[..., Any], arg_types: Sequence[Any]):
        self.name = name
        self.binding = binding
        self.__name__ = getattr(binding, "__name__", name)
        self.__qualname__ = getattr(binding, "__qualname__", self.__name__)
        self.__module__ = getattr(binding, "__module__", None) or __name__
        kinds = param_kinds(arg_types)
        self.params: tuple[str, ...] = kinds or ()
        self.address: int | None = None
        if kinds is not None and len(kinds) <= MAX_ARGS and direct_calls_supported():
            self.address = _address(binding, "kernel")

    def __call__(self, *args: Any) -> Any:
        return self.binding(*args)

    def __repr__(self) -> str:
        native = f"at {self.address:#x}" if self.address else "Python only"
        return f"<CKernel {self.name} ({', '.join(self.params)}) {native}>"


__all__ = ["CKernel", "INT", "MAX_ARGS", "POINTER", "direct_calls_supported", "param_kinds"]
