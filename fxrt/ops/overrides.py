"""User kernel overrides and kernel libraries: new ops reach fxrt without changes to the runtime.

Three ways in, none of which touches the loops:

* **New ops from C++.** :func:`load_kernel_library` loads a shared library whose static
  initializers register ops with ``TORCH_LIBRARY`` (through ``torch.ops.load_library``). Such ops
  are ``OpOverload`` objects with a schema like any ATen op, so ``from_fx`` makes them ATen nodes,
  ``lower`` makes them ``Call`` instructions, and the compiled loop finds them by schema name in the
  dispatcher and calls them boxed, without Python. Tracing them (``torch.compile``, ``make_fx``)
  needs a ``Meta`` kernel or a Python fake implementation (``torch.library.register_fake``).
* **New ops from Python.** An op made with ``torch.library.custom_op`` (with a fake
  implementation) is also an ``OpOverload``; the loop dispatches to it, and the dispatcher calls
  its Python kernel. Nothing here is needed for it; the tests cover it.
* **Overrides.** :func:`register_kernel` routes an op (``aten::gelu``) to another registered op
  with the same argument and return types, or to a Python callable, *inside graphs fxrt compiles*.
  Eager PyTorch is unaffected: nothing is registered with the dispatcher. The rewrite happens once
  per compile, in :func:`apply_kernel_overrides`, the compile pipeline's stage right after the
  conversion to IR (:mod:`fxrt.pipeline`), before the built-in passes: an ATen node whose op has
  an override gets the replacement op (its arguments re-bound to the replacement's schema by
  position, so argument names may differ) or, for a callable, becomes a Python fallback node
  calling it. The compile cache key includes
  :func:`registry_fingerprint`, so changing the registry never serves a graph compiled under the
  old one. Overrides are not chained: the replacement op is not looked up again.

A kernel library declares overrides from C++ through one optional ``extern "C"`` entry point,
:data:`ENTRY_POINT`, that :func:`load_kernel_library` calls after loading it::

    extern "C" void fxrt_register_kernels(
        void (*reg)(const char* op, const char* replacement)) {
      reg("aten::gelu", "mylib::fast_gelu");  // "ns::name" or "ns::name.overload"
    }

Every declared override is checked (both ops exist, types match) before any is registered, so a
library with one bad declaration registers none and :func:`load_kernel_library` raises.
"""

from __future__ import annotations

import ctypes
import errno
import inspect
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ..fingerprint import fingerprint
from ..ir.graph import Graph, Op, OpKind, callable_name

ENTRY_POINT = "fxrt_register_kernels"
"""The optional ``extern "C"`` symbol a kernel library exports to declare overrides."""

_REGISTER_FN = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p)


@dataclass(frozen=True)
class KernelOverride:
    """One registry entry: ``op`` (e.g. ``"aten::gelu"``) runs ``target`` in fxrt graphs.

    Attributes:
        op: the overridden op's name, ``"ns::name"`` or ``"ns::name.overload"``.
        target: the replacement ``OpOverload``, or a Python callable.
        source: where it was registered: ``"python"`` or the kernel library's path.
    """

    op: str
    target: Any
    source: str

    @property
    def is_op(self) -> bool:
        return isinstance(self.target, torch._ops.OpOverload)

    def describe(self) -> str:
        """A stable text for the cache key: the replacement's name and schema, or for a Python
        function its fingerprint (code, closure, globals; raises ``fxrt.fingerprint.Unkeyable``)."""
        if self.is_op:
            return f"op:{self.target._schema}"
        return f"python:{callable_name(self.target)}:{fingerprint(self.target)}"


@dataclass(frozen=True)
class KernelLibrary:
    """What :func:`load_kernel_library` loaded.

    Attributes:
        path: the library's absolute path.
        ops: the ops its loading registered with the dispatcher (``"ns::name"``, overload names
            included, sorted); empty when the library was already loaded outside fxrt.
        overrides: the ``(op, replacement)`` pairs it declared through :data:`ENTRY_POINT`.
    """

    path: str
    ops: tuple[str, ...]
    overrides: tuple[tuple[str, str], ...]


_lock = threading.Lock()
# Replaced, never mutated, under _lock: a compile reads one consistent snapshot without locking.
_overrides: Mapping[str, KernelOverride] = MappingProxyType({})
_libraries: dict[str, KernelLibrary] = {}


def op_name(op: torch._ops.OpOverload) -> str:
    """``"aten::gelu"`` for a default overload, ``"aten::add.Tensor"`` otherwise (as the IR and
    the program listing name ops)."""
    schema = op._schema
    return str(schema.name) + (f".{schema.overload_name}" if schema.overload_name else "")


def _resolve_op(op: Any, what: str) -> torch._ops.OpOverload:
    """An ``OpOverload`` from an overload, a packet (its default overload), a ``custom_op``
    object or a ``"ns::name[.overload]"`` string."""
    if isinstance(op, torch._ops.OpOverload):
        return op
    custom = getattr(op, "_opoverload", None)  # torch.library.custom_op's CustomOpDef
    if isinstance(custom, torch._ops.OpOverload):
        return custom
    if isinstance(op, torch._ops.OpOverloadPacket):
        if "default" not in op.overloads():
            raise ValueError(
                f"fxrt: {what} {op._qualified_op_name} has no default overload; name one of "
                f"{sorted(op.overloads())}"
            )
        return op.default
    if isinstance(op, str):
        ns, sep, rest = op.partition("::")
        base, _, overload = rest.partition(".")
        if not sep or not ns or not base:
            raise ValueError(f"fxrt: {what} {op!r} is not an op name like 'aten::gelu'")
        try:
            return getattr(getattr(getattr(torch.ops, ns), base), overload or "default")
        except (AttributeError, RuntimeError) as e:
            raise ValueError(
                f"fxrt: {what} {op!r} is not a registered op (load its library first)"
            ) from e
    raise TypeError(f"fxrt: {what} must be an op or an op name, got {type(op).__name__}")


def _type_signature(schema: torch.FunctionSchema) -> tuple[list[str], list[str]]:
    """Argument and return types, with whether each aliases (``(a)``) or is written (``(!)``);
    names, defaults and kwarg-only markers are left out."""

    def one(a: Any) -> str:
        info = a.alias_info
        return str(a.type) + ("" if info is None else "(!)" if info.is_write else "(a)")

    return [one(a) for a in schema.arguments], [one(r) for r in schema.returns]


def check_schemas_match(op: torch._ops.OpOverload, replacement: torch._ops.OpOverload) -> None:
    """Raise ValueError (printing both schemas) unless ``replacement`` takes and returns the
    same types as ``op``, in the same order, with the same aliasing and mutation."""
    if _type_signature(op._schema) != _type_signature(replacement._schema):
        raise ValueError(
            "fxrt: override schema does not match (argument and return types must be equal; "
            f"names may differ):\n  op:          {op._schema}\n"
            f"  replacement: {replacement._schema}"
        )


def _check_callable(op: torch._ops.OpOverload, fn: Callable[..., Any]) -> None:
    """A callable override must accept every argument the op's schema can be called with."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to check before it runs
    args = op._schema.arguments
    positional = [None for a in args if not a.kwarg_only]
    keywords = {a.name: None for a in args if a.kwarg_only}
    try:
        sig.bind(*positional, **keywords)
    except TypeError as e:
        raise ValueError(
            f"fxrt: override {callable_name(fn)}{sig} cannot be called like {op._schema} "
            f"(positional arguments by position, keyword-only ones by name): {e}"
        ) from None


def _make_override(op: Any, impl: Any, source: str) -> KernelOverride:
    target = _resolve_op(op, "op")
    if isinstance(impl, torch._ops.OpOverloadPacket):
        matching = [
            getattr(impl, name)
            for name in impl.overloads()
            if _type_signature(getattr(impl, name)._schema) == _type_signature(target._schema)
        ]
        impl = matching[0] if len(matching) == 1 else impl
    if isinstance(impl, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or isinstance(
        getattr(impl, "_opoverload", None), torch._ops.OpOverload
    ):
        replacement: Any = _resolve_op(impl, "replacement")
        check_schemas_match(target, replacement)
    elif callable(impl):
        replacement = impl
        _check_callable(target, impl)
    else:
        raise TypeError(f"fxrt: impl must be an op, an op name or a callable, got {impl!r:.60}")
    return KernelOverride(op_name(target), replacement, source)


def _commit(entries: list[KernelOverride]) -> None:
    global _overrides
    with _lock:
        new = dict(_overrides)
        new.update((e.op, e) for e in entries)
        _overrides = MappingProxyType(new)


def register_kernel(op: Any, impl: Any = None) -> Any:
    """Route ``op`` to ``impl`` inside graphs fxrt compiles from now on; eager is unaffected.

    ``impl`` replaces the op at compile time: another registered op runs natively in the
    compiled loop (its arguments are passed by position, so names may differ); a Python callable
    makes the node a fallback that calls it with the op's arguments. Registering an op again
    replaces its override. Without ``impl``, returns a decorator.

    Args:
        op: the op to override: an ``OpOverload`` (``torch.ops.aten.gelu.default``), a packet
            (its default overload), a ``custom_op`` object, or a name (``"aten::gelu"``,
            ``"aten::add.Tensor"``).
        impl: an op (same forms as ``op``) with the same argument and return types, or a
            callable that accepts the op's arguments.

    Returns:
        ``impl`` (or the decorator).

    Raises:
        ValueError: an op name is unknown, or ``impl``'s schema does not match ``op``'s (both
            are printed), or the callable cannot take the op's arguments.
        TypeError: ``op`` or ``impl`` is neither an op, a name nor a callable.

    Example::

        fxrt.register_kernel("aten::gelu", "mylib::fast_gelu")

        @fxrt.register_kernel(torch.ops.aten.gelu.default)
        def my_gelu(x, *, approximate="none"):
            ...
    """
    if impl is None:
        return lambda fn: register_kernel(op, fn)
    _commit([_make_override(op, impl, "python")])
    return impl


def unregister_kernel(op: Any) -> KernelOverride | None:
    """Remove ``op``'s override (for graphs compiled from now on).

    Args:
        op: the overridden op, in any form :func:`register_kernel` takes.

    Returns:
        The removed :class:`KernelOverride`, or None if ``op`` had none.
    """
    global _overrides
    name = op_name(_resolve_op(op, "op"))
    with _lock:
        new = dict(_overrides)
        removed = new.pop(name, None)
        _overrides = MappingProxyType(new)
    return removed


def kernel_overrides() -> Mapping[str, KernelOverride]:
    """The current registry, op name -> :class:`KernelOverride` (a read-only snapshot)."""
    return _overrides


def registry_fingerprint() -> str:
    """A stable text naming every override; part of the compile cache key."""
    return ";".join(f"{name}->{o.describe()}" for name, o in sorted(_overrides.items()))


def load_kernel_library(path: str | os.PathLike[str]) -> KernelLibrary:
    """Load a shared library of ops (``TORCH_LIBRARY``) and the overrides it declares.

    The library is loaded with ``torch.ops.load_library``; its ops are then ordinary
    ``torch.ops.<ns>.<name>`` ops that compiled graphs run natively in the compiled loop (boxed
    dispatch). To be traced by ``torch.compile`` an op needs a ``Meta`` kernel (or a Python
    ``torch.library.register_fake``). If the library exports :data:`ENTRY_POINT`::

        extern "C" void fxrt_register_kernels(
            void (*reg)(const char* op, const char* replacement));

    fxrt calls it once per load with a ``reg`` function; each ``reg("aten::gelu",
    "mylib::fast_gelu")`` declares an override, exactly as :func:`register_kernel` would. All
    declarations are checked before any is registered. Loading a library again does not load it
    twice, but calls its entry point again (restoring overrides removed since).

    Args:
        path: the library file (``.so``/``.dylib``/``.dll``).

    Returns:
        A :class:`KernelLibrary`: the path, the ops it registered and the overrides it declared.

    Raises:
        FileNotFoundError: no file at ``path``.
        OSError: the loader refused the file (not a shared library, missing symbols, another
            torch's ABI); the message names the path and gives the loader's message.
        RuntimeError: the library's registrations failed while loading.
        ValueError: a declared override names an unknown op or does not match its schema.
    """
    p = os.path.abspath(os.fspath(path))
    if not os.path.isfile(p):
        raise FileNotFoundError(errno.ENOENT, "fxrt: kernel library not found", p)
    before = set(torch._C._dispatch_get_all_op_names())
    try:
        torch.ops.load_library(p)
    except OSError as e:
        raise OSError(f"fxrt: cannot load kernel library {p}: {e}") from e
    except Exception as e:  # a registration error raised while the library initializes
        raise RuntimeError(
            f"fxrt: loading kernel library {p} failed: {type(e).__name__}: {e}"
        ) from e
    new_ops = tuple(sorted(set(torch._C._dispatch_get_all_op_names()) - before))
    declared = _declared_overrides(p)
    entries = []
    for op, replacement in declared:
        try:
            entries.append(_make_override(op, replacement, p))
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"fxrt: kernel library {p} declares override {op} -> {replacement}, which is "
                f"invalid; none of its overrides were registered.\n{e}"
            ) from e
    _commit(entries)
    with _lock:
        previous = _libraries.get(p)
        lib = KernelLibrary(p, new_ops or (previous.ops if previous else ()), tuple(declared))
        _libraries[p] = lib
    return lib


def _declared_overrides(path: str) -> list[tuple[str, str]]:
    """Call the library's :data:`ENTRY_POINT`, if it has one, and collect what it declares."""
    handle = ctypes.CDLL(path)  # the handle torch.ops.load_library opened (dlopen counts refs)
    entry = getattr(handle, ENTRY_POINT, None)
    if entry is None:
        return []
    entry.argtypes = [_REGISTER_FN]
    entry.restype = None
    raw: list[tuple[bytes | None, bytes | None]] = []
    # Exceptions cannot cross the C boundary (ctypes would print and drop them): only record.
    entry(_REGISTER_FN(lambda op, replacement: raw.append((op, replacement))))
    declared = []
    for op, replacement in raw:
        if not op or not replacement:
            raise ValueError(f"fxrt: kernel library {path} passed a null op name to reg()")
        declared.append((op.decode(), replacement.decode()))
    return declared


def apply_kernel_overrides(graph: Graph) -> Graph:
    """Rewrite ``graph``'s ATen nodes that have an override (in place); return the graph.

    A replacement op takes the node's place with its arguments re-bound by position to the
    replacement's schema; omitted arguments whose defaults differ between the two schemas are
    passed explicitly with the original op's default. A callable turns the node into a Python
    fallback calling it with the node's arguments unchanged.
    """
    overrides = _overrides
    if not overrides:
        return graph
    for node in graph.nodes:
        if node.op.kind is not OpKind.ATEN:
            continue
        o = overrides.get(node.op.name)
        if o is None:
            continue
        if o.is_op:
            node.args, node.kwargs = _rebind(node.args, node.kwargs, node.op.target, o.target)
            node.op = Op.of(o.target)
        else:
            node.op = Op(OpKind.PYTHON, o.target, callable_name(o.target))
    return graph


def _rebind(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    op: torch._ops.OpOverload,
    replacement: torch._ops.OpOverload,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    src, dst = op._schema.arguments, replacement._schema.arguments
    index = {a.name: i for i, a in enumerate(src)}
    by_index: dict[int, Any] = dict(enumerate(args))
    for name, value in kwargs.items():
        by_index[index[name]] = value
    for i, (s, d) in enumerate(zip(src, dst)):
        if i in by_index or not s.has_default_value():
            continue
        if not d.has_default_value() or not _same(s.default_value, d.default_value):
            by_index[i] = s.default_value
    new_args: list[Any] = []
    new_kwargs: dict[str, Any] = {}
    for i in sorted(by_index):
        if not dst[i].kwarg_only and i == len(new_args):
            new_args.append(by_index[i])
        else:
            new_kwargs[dst[i].name] = by_index[i]
    return tuple(new_args), new_kwargs


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


__all__ = [
    "ENTRY_POINT",
    "KernelLibrary",
    "KernelOverride",
    "apply_kernel_overrides",
    "check_schemas_match",
    "kernel_overrides",
    "load_kernel_library",
    "register_kernel",
    "registry_fingerprint",
    "unregister_kernel",
]
