"""fxrt's intermediate representation.

A :class:`Graph` is a list of :class:`Node` in execution order over dense integer value ids. Each
value is defined once: by a graph input, by a constant the graph owns, or as one output of a node.
The leaves (:class:`TensorMeta`, :class:`Value`, :class:`Ref`, :class:`Op`) are frozen; passes edit
only the ``Graph`` and its ``Node`` objects.

Node arguments keep the shape of the FX arguments they came from: Python constants, :class:`Ref`
to a value, and lists/tuples of those (a ``Tensor[]`` argument such as ``cat``'s is a list of refs).

This module is the bottom of the package: it imports nothing else of fxrt. The text form of a
graph is :func:`fxrt.ir.graph_to_text` (:mod:`fxrt.ir.printer`), which reads these classes.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Static facts about a tensor value. Symbolic sizes are kept as their printed expression."""

    shape: tuple[int | str, ...]
    stride: tuple[int | str, ...]
    dtype: torch.dtype
    device: str
    # Bytes of the storage the tensor lives in: an int, or a sympy expression in the size symbols
    # (``"4*s0*s1"``) when sizes are symbolic; None when unknown.
    storage_nbytes: int | str | None = None

    @property
    def is_static(self) -> bool:
        return all(isinstance(s, int) for s in self.shape + self.stride)

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        dims = ", ".join(str(s) for s in self.shape)
        return f"{dt}[{dims}]" + ("" if self.device == "cpu" else f"@{self.device}")


def is_contiguous(meta: TensorMeta) -> bool:
    """``meta``'s strides are the contiguous ones for its (static or symbolic) shape."""
    expected: Any = 1
    for size, stride in zip(reversed(meta.shape), reversed(meta.stride)):
        if size != 1 and stride != expected:
            return False
        expected = size if expected == 1 else _product(expected, size)
    return True


def dense_rows(meta: TensorMeta) -> bool:
    """``meta``'s memory holds its rows as whole runs of the last dimension: contiguous, or dense
    with the last dimension innermost, as a transpose of the dimensions before it leaves them. A
    row kernel may then run over such memory as ``numel / n`` rows of ``n``. Symbolic strides are
    compared as expressions (a dimension of symbolic size is at least 2 under Dynamo)."""
    if is_contiguous(meta):
        return True
    if meta.shape[-1] != 1 and meta.stride[-1] != 1:
        return False
    dims = [(size, stride) for size, stride in zip(meta.shape, meta.stride) if size != 1]
    expected: Any = 1
    while dims:  # the dimension whose stride is the product of the sizes inside it, in turn
        step = next((d for d in dims if _same(d[1], expected)), None)
        if step is None:
            return False
        dims.remove(step)
        expected = _product(expected, step[0])
    return True


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    import sympy

    return sympy.simplify(sympy.sympify(str(a)) - sympy.sympify(str(b))) == 0


def _product(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return f"{a}*{b}"  # symbolic: compared as printed, which is what the IR holds


class ValueKind(enum.Enum):
    TENSOR = "tensor"
    SYM = "sym"  # SymInt / SymFloat / SymBool
    SCALAR = "scalar"  # a concrete Python number or bool
    NONE = "none"  # known to be None (e.g. a kernel call that writes into its arguments)
    OTHER = "other"  # lists, modules, opaque objects, or unknown


@dataclass(frozen=True, slots=True)
class Value:
    id: int
    name: str
    kind: ValueKind
    meta: TensorMeta | None = None
    expr: str | None = None  # the symbolic expression of a SYM value


@dataclass(frozen=True, slots=True)
class Ref:
    """An argument that reads the value with id ``id``."""

    id: int

    def __repr__(self) -> str:
        return f"%{self.id}"


class OpKind(enum.Enum):
    ATEN = "aten"  # a torch OpOverload with a schema: runs natively in the compiled loop
    PYTHON = "python"  # any other callable: runs as a fallback that calls back into Python


@dataclass(frozen=True, slots=True)
class Op:
    kind: OpKind
    target: Any = field(compare=False)
    name: str

    @property
    def schema(self) -> torch.FunctionSchema | None:
        return self.target._schema if self.kind is OpKind.ATEN else None

    @staticmethod
    def of(target: Any) -> Op:
        if isinstance(target, torch._ops.OpOverload):
            return _aten_op(target)
        return Op(OpKind.PYTHON, target, callable_name(target))


@functools.cache
def _aten_op(target: torch._ops.OpOverload) -> Op:
    # One Op per overload, shared by every node that calls it (an Op is immutable): building
    # the name from the schema showed up in the conversion of long graphs.
    return Op(
        OpKind.ATEN,
        target,
        str(target._schema.name)
        + (f".{target._overloadname}" if target._overloadname != "default" else ""),
    )


def callable_name(fn: Any) -> str:
    if isinstance(fn, torch._ops.HigherOrderOperator):
        return f"higher_order.{fn.name()}"
    mod = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if mod in ("_operator", "operator"):
        mod = "operator"
    return f"{mod}.{name}" if mod and mod != "builtins" else name


@dataclass(slots=True)
class Node:
    """One operation. ``outputs`` are the ids it defines; ``multi`` says the op returns a sequence
    whose elements are unpacked into ``outputs`` (one element each); ``copies`` is explained
    below."""

    name: str
    op: Op
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[int]
    multi: bool = False
    stack_trace: str | None = None
    # The schema says the result may alias an input, but the op copied when traced (``reshape``
    # of a tensor no view can express, ``contiguous`` of a strided one): the result is fresh.
    copies: bool = False

    def input_ids(self) -> list[int]:
        found: list[int] = []
        _collect_refs(self.args, found)
        if self.kwargs:
            _collect_refs(self.kwargs, found)
        return found


@dataclass(slots=True)
class Graph:
    values: list[Value] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    constants: dict[int, Any] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    # The graph's result: the same nesting as the FX output (a tuple, a list or one value) of
    # Ref and constants.
    output: Any = None

    def add_value(
        self, name: str, kind: ValueKind, meta: TensorMeta | None = None, expr: str | None = None
    ) -> int:
        vid = len(self.values)
        self.values.append(Value(vid, name, kind, meta, expr))
        return vid

    def output_ids(self) -> list[int]:
        return refs_in(self.output)


def refs_in(tree: Any) -> list[int]:
    """Ids of every Ref in a nested structure of tuples, lists, slices and dicts, in order."""
    found: list[int] = []
    _collect_refs(tree, found)
    return found


def _collect_refs(x: Any, found: list[int]) -> None:
    # Every pass and planning step calls this on every node's arguments, which are mostly a flat
    # tuple of refs and numbers: the leaves of a sequence are handled in the loop itself, and
    # only nested containers recurse.
    if isinstance(x, Ref):
        found.append(x.id)
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, Ref):
                found.append(y.id)
            elif isinstance(y, (list, tuple, dict, slice)):
                _collect_refs(y, found)
    elif isinstance(x, dict):
        for y in x.values():
            _collect_refs(y, found)
    elif isinstance(x, slice):
        _collect_refs(x.start, found)
        _collect_refs(x.stop, found)
        _collect_refs(x.step, found)


def map_refs(tree: Any, fn) -> Any:
    """Rebuild a nested structure, replacing each Ref by ``fn(ref)``."""
    if isinstance(tree, Ref):
        return fn(tree)
    if isinstance(tree, tuple):
        return tuple(map_refs(x, fn) for x in tree)
    if isinstance(tree, list):
        return [map_refs(x, fn) for x in tree]
    if isinstance(tree, dict):
        return {k: map_refs(v, fn) for k, v in tree.items()}
    if isinstance(tree, slice):
        return slice(map_refs(tree.start, fn), map_refs(tree.stop, fn), map_refs(tree.step, fn))
    return tree


def substitute_refs(tree: Any, mapping: dict[int, int]) -> Any:
    """``tree`` with every Ref whose id is a key of ``mapping`` reading ``mapping[id]`` instead.

    Unlike ``map_refs``, what holds no such Ref comes back as the very same object (no copy), so
    a pass that rewrites the uses of a few values leaves every other node's arguments untouched:
    cheaper, and the pass manager sees by identity that those nodes did not change. For IR
    arguments only, which nothing mutates in place; a loop binding registers must copy
    (``map_refs``)."""
    if not mapping:
        return tree
    if isinstance(tree, Ref):
        new = mapping.get(tree.id)
        return tree if new is None else Ref(new)
    if isinstance(tree, (tuple, list)):
        items = [substitute_refs(x, mapping) for x in tree]
        if all(a is b for a, b in zip(items, tree)):
            return tree
        return tuple(items) if isinstance(tree, tuple) else items
    if isinstance(tree, dict):
        new_items = {k: substitute_refs(v, mapping) for k, v in tree.items()}
        if all(new_items[k] is v for k, v in tree.items()):
            return tree
        return new_items
    if isinstance(tree, slice):
        parts = [substitute_refs(x, mapping) for x in (tree.start, tree.stop, tree.step)]
        if all(a is b for a, b in zip(parts, (tree.start, tree.stop, tree.step))):
            return tree
        return slice(*parts)
    return tree
