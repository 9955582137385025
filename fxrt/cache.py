"""Compile-cache keys: what a cached graph's behaviour depends on, hashed.

A key is a SHA-256 of:

* the canonical IR text of the graph fxrt was handed (every op, argument, input and output type),
  and for each Python callable in it that is not torch's or Python's own (an ``allow_in_graph``
  helper, a function in a hand-built graph) its *fingerprint*: its bytecode, constants, default
  arguments, the values it closes over and the globals it reads, recursively. That is everything
  tracing the graph to ATen depends on besides torch itself, so the key determines the ATen graph
  fxrt compiles without paying for the trace;
* the sizes, strides, dtypes, devices and ``requires_grad`` of the inputs, and the same plus the
  bytes of every constant the graph owns;
* the compiler config, user passes and kernel overrides by fingerprint, fxrt's own CPU ops, the
  artifact format, the torch and fxrt versions and a SHA-256 of the content of fxrt's sources and
  of its built extension.

What cannot be fingerprinted (an object of unknown type in a closure, a module-level object a
function reads) makes the graph uncached: it is compiled every time, and the ``fxrt`` logger says
why at debug level. Keys never use ``id()``. Keys are computed outside any fake or dispatch mode.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import os
import types
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from .cachestore import SUFFIX, Store, cache_dir, default_dir  # noqa: F401 (re-exported)

stats: Counter[str] = Counter()  # "hit", "miss", "stored", "rejected", "uncached", "compiled"
log = logging.getLogger("fxrt")
# Where things go, or how the loaded program runs (a hit is lowered under the caller's config):
# not what is compiled.
_NOT_KEYED = (
    "dump_dir",
    "cache",
    "cache_dir",
    "cache_max_bytes",
    "pure_python",
    "check_inputs",
    "arena_max_idle",
)
_TRUSTED_MODULES = ("torch", "operator", "_operator", "math", "builtins", "functools", "fxrt")


class Unkeyable(Exception):
    """Something the key must cover cannot be fingerprinted; the reason says what."""


_SOURCE_SUFFIXES = (".py", ".pyx", ".pxd", ".h", ".so")


@functools.cache
def source_hash() -> str:
    """SHA-256 of the content of fxrt's sources and built extension: a changed fxrt never reads
    an older fxrt's entries. Once per process (about 3 ms)."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(__file__))
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
        elif _trusted(x):
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
        if _trusted(fn):
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


def _trusted(x: Any) -> bool:
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


# ----------------------------------------------------------------------------------------------
# The key


def _describe_input(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{x.dtype}{tuple(x.shape)}{x.stride()}{x.device}{x.requires_grad}"
    if isinstance(x, torch.SymInt):
        raise Unkeyable("a symbolic input")
    return f"{type(x).__name__}:{x!r}"


def config_text(config: Any) -> str:
    parts = []
    for f in dataclasses.fields(config):
        if f.name in _NOT_KEYED:
            continue
        v = getattr(config, f.name)
        if callable(v):
            try:
                v = "fingerprint:" + fingerprint(v)
            except Unkeyable as e:
                raise Unkeyable(f"option {f.name}: {e}") from None
        parts.append(f"{f.name}={v!r}")
    return ";".join(parts)


def cache_key(graph: Any, example_inputs: Sequence[Any], config: Any) -> str:
    """The key of ``graph`` (fxrt IR) compiled for ``example_inputs`` under ``config``.

    Raises:
        Unkeyable: the graph, its constants or the config cannot be fingerprinted.
    """
    from .artifact import MAGIC
    from .ir import graph_to_text
    from .ir.graph import OpKind
    from .ops.kernels import registry_fingerprint
    from .ops.native_kernels import available as native_kernels_available
    from .serialize import FORMAT, versions

    h = hashlib.sha256()
    text = graph_to_text(graph)
    try:
        kernels = registry_fingerprint()
    except Unkeyable as e:
        raise Unkeyable(f"a kernel override: {e}") from None
    native = ",".join(sorted(native_kernels_available()))
    head = (FORMAT, MAGIC, sorted(versions().items()), config_text(config), kernels, native)
    for part in (*map(repr, head), text):
        h.update(part.encode() + b"\0")
    for node in graph.nodes:
        if node.op.kind is OpKind.PYTHON and not (
            _trusted(node.op.target) or node.op.name.startswith("method.")  # by its name
        ):
            try:
                h.update(f"{node.name}:{fingerprint(node.op.target)}".encode())
            except Unkeyable as e:
                raise Unkeyable(f"node {node.name} calls {node.op.name}, which holds {e}") from None
    for x in example_inputs:
        h.update(_describe_input(x).encode())
    for vid, c in graph.constants.items():
        try:
            h.update(f"{vid}:{fingerprint(c)}".encode())
        except Unkeyable as e:
            raise Unkeyable(f"constant {graph.values[vid].name} is {e}") from None
    return h.hexdigest()


def open_store(config: Any) -> Store | None:
    """The configured cache directory, or None if it is unusable (after one warning)."""
    return Store.open(cache_dir(config.cache_dir), config.cache_max_bytes)


def graph_name(graph: Any) -> str:
    """What a log line calls a graph: the user function and source line of its first node."""
    for node in graph.nodes:
        trace = node.stack_trace
        if trace:
            for line in trace.strip().splitlines():
                line = line.strip()
                if line.startswith("File "):
                    try:
                        file_part, line_part, func = line.split(", ", 2)
                        file = os.path.basename(file_part[len("File ") :].strip('"'))
                        return f"{func.removeprefix('in ')} ({file}:{line_part.split()[-1]})"
                    except ValueError:
                        break
    return f"graph of {len(graph.nodes)} ops"


def configure_logging() -> None:
    """``FXRT_LOG=info`` (or debug, warning) turns the ``fxrt`` logger on from the environment."""
    level = os.environ.get("FXRT_LOG", "").strip().upper()
    if not level:
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(
            f"environment variable FXRT_LOG={level.lower()!r}: expected debug, info, "
            "warning or error"
        )
    log.setLevel(level)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        log.addHandler(handler)


configure_logging()
