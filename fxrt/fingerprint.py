"""Fingerprints: stable texts that change whenever an object would behave differently.

The compile cache keys a graph on what its behaviour depends on (:mod:`fxrt.cache`); the parts
that are Python objects, not IR, are fingerprinted here:

* :func:`fingerprint` of a Python object: for a function its bytecode, constants, default
  arguments, the values it closes over and the globals it reads, recursively; for a tensor its
  metadata and a SHA-256 of its bytes (:func:`tensor_digest`); containers, dataclasses and
  classes by their contents. torch's and Python's own functions and ops are named, not walked:
  the versions in the key cover them. What cannot be fingerprinted (an object of unknown type)
  raises :class:`Unkeyable`, which says what it was.
* :func:`source_hash`: a SHA-256 of the content of fxrt's own sources and built extension, so a
  changed fxrt never reads an older fxrt's cache entries or artifacts.

User passes, kernel overrides (:mod:`fxrt.ops.overrides`) and the cache key use them; nothing here
imports the rest of fxrt.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import types
from typing import Any

import torch

_TRUSTED_MODULES = ("torch", "operator", "_operator", "math", "builtins", "functools", "fxrt")


class Unkeyable(Exception):
    """Something the key must cover cannot be fingerprinted; the reason says what."""


_SOURCE_SUFFIXES = (".py", ".pyx", ".pxd", ".h", ".so")


@functools.cache
def source_hash() -> str:
    """SHA-256 of the content of fxrt's sources and built extension: a changed fxrt never reads
    an older fxrt's entries. Once per process (about 3 ms)."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(__file__))  # the fxrt package
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        files += [os.path.join(folder, n) for n in names if n.endswith(_SOURCE_SUFFIXES)]
    for path in sorted(files):
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:32]


# ----------------------------------------------------------------------------------------------
# Fingerprints


def tensor_digest(t: torch.Tensor) -> str:
    """Metadata and a SHA-256 of the bytes of a real tensor (run outside fake/dispatch modes)."""
    head = f"T{t.dtype}{tuple(t.shape)}{t.stride()}{t.device}{t.requires_grad}"
    if t.layout != torch.strided or t.is_meta or not _is_plain(t):
        raise Unkeyable(f"a {type(t).__name__} ({t.layout}, {t.device}) cannot be fingerprinted")
    flat = t.detach().contiguous().cpu()
    data = flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return head + hashlib.sha256(data).hexdigest()


def _is_plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)


def fingerprint(obj: Any) -> str:
    """A stable text that changes whenever ``obj`` would behave differently as code or data.

    Raises:
        Unkeyable: ``obj`` (or something it reaches) is of a kind that cannot be fingerprinted.
    """
    h = hashlib.sha256()
    _Fingerprinter(h).add(obj)
    return h.hexdigest()


class _Fingerprinter:
    MAX_ITEMS = 100_000

    def __init__(self, h: Any):
        self.h = h
        self.seen: dict[int, int] = {}  # id -> position, for cycles (a recursive function)
        self.items = 0

    def put(self, *parts: Any) -> None:
        for p in parts:
            self.h.update(str(p).encode() + b"\x1f")

    def add(self, x: Any) -> None:
        self.items += 1
        if self.items > self.MAX_ITEMS:
            raise Unkeyable("reaches too many objects to fingerprint")
        if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
            self.put(type(x).__name__, repr(x))
            return
        if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            self.put("torch", x)
            return
        if isinstance(x, enum.Enum):
            self.put("enum", type(x).__qualname__, x.name)
            return
        if id(x) in self.seen:
            self.put("seen", self.seen[id(x)])
            return
        self.seen[id(x)] = len(self.seen)
        if isinstance(x, torch.Size):
            self.put("size", tuple(x))
        elif isinstance(x, torch.Tensor):
            self.put(tensor_digest(x))
        elif isinstance(x, (list, tuple)):
            self.put(type(x).__name__, len(x))
            for y in x:
                self.add(y)
        elif isinstance(x, dict):
            self.put("dict", len(x))
            for k, v in x.items():
                self.add(k)
                self.add(v)
        elif isinstance(x, (set, frozenset)):
            self.put("set", sorted(fingerprint(y) for y in x))
        elif isinstance(x, types.ModuleType):
            self.put("module", x.__name__)
        elif isinstance(x, types.CodeType):
            self.code(x, None)
        elif isinstance(x, types.FunctionType):
            self.function(x)
        elif isinstance(x, types.MethodType):
            self.put("method")
            self.add(x.__func__)
            self.add(x.__self__)
        elif isinstance(x, functools.partial):
            self.put("partial")
            self.add(x.func)
            self.add(x.args)
            self.add(x.keywords)
        elif isinstance(x, torch.fx.GraphModule):
            self.put("graph_module", x.code)
            self.add({k: v for k, v in x.named_buffers()})
            self.add({k: v for k, v in x.named_parameters()})
        elif is_trusted(x):
            self.put("named", getattr(x, "__module__", ""), _qualname(x))
        elif isinstance(x, type):
            self.put("class", x.__module__, x.__qualname__)
            for name, member in sorted(vars(x).items()):
                if isinstance(member, (types.FunctionType, staticmethod, classmethod, property)):
                    self.put(name)
                    self.add(getattr(member, "__func__", getattr(member, "fget", member)))
        elif dataclasses.is_dataclass(x):
            self.put("dataclass", type(x).__module__, type(x).__qualname__)
            self.add([getattr(x, f.name) for f in dataclasses.fields(x)])
        else:
            raise Unkeyable(f"a {type(x).__module__}.{type(x).__qualname__} object")

    def function(self, fn: types.FunctionType) -> None:
        if is_trusted(fn):
            self.put("named", fn.__module__, fn.__qualname__)
            return
        self.put("function", fn.__module__, fn.__qualname__)
        self.code(fn.__code__, fn.__globals__)
        self.add(fn.__defaults__)
        self.add(fn.__kwdefaults__)
        for cell in fn.__closure__ or ():
            try:
                self.add(cell.cell_contents)
            except ValueError:  # an empty cell
                self.put("empty cell")

    def code(self, co: types.CodeType, globals_: dict[str, Any] | None) -> None:
        self.put("code", co.co_code.hex(), co.co_names, co.co_varnames, co.co_freevars)
        for c in co.co_consts:
            if isinstance(c, types.CodeType):
                self.code(c, globals_)
            else:
                self.add(c)
        if globals_ is not None:
            for name in co.co_names:  # globals it may read (attribute names are skipped)
                if name in globals_:
                    self.put("global", name)
                    self.add(globals_[name])


def _qualname(x: Any) -> str:
    return getattr(x, "__qualname__", None) or getattr(x, "__name__", None) or type(x).__name__


_CALLABLE_TYPES = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
    type,
)


def is_trusted(x: Any) -> bool:
    """torch's and Python's own ops and functions (not their objects, which hold state): the
    versions in the key cover them."""
    if isinstance(x, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    if isinstance(x, torch._ops.HigherOrderOperator):
        return True
    if not isinstance(x, _CALLABLE_TYPES):
        return False
    mod = getattr(x, "__module__", None) or ""
    return mod.split(".")[0] in _TRUSTED_MODULES


__all__ = ["Unkeyable", "fingerprint", "is_trusted", "source_hash", "tensor_digest"]
