"""A package's calling convention: what the caller passes, what the graph takes, what comes back.

``torch.export`` flattens a call ``model(*args, **kwargs)`` with ``torch.utils._pytree`` into
leaves (its *in spec* says how) and lifts the model's parameters, buffers and tensor constants to
graph inputs in front of them. The graph returns the new values of mutated buffers and inputs
first, then the user's outputs, which the *out spec* nests again (tuples, dicts, a HuggingFace
``ModelOutput``). :class:`Signature` records, per graph input, where its value comes from (a
weight by name, a leaf of the call by path, or a constant the export specialized on), per graph
output where it goes, the ranges of the size symbols and the names of the ``Dim``s they came
from; :meth:`Signature.from_json` checks every field of it. :mod:`fxrt.deploy.binder` applies it
on each call.

The in and out specs are stored as ``torch.utils._pytree.treespec_dumps`` JSON and read back by
:func:`spec_from_json`, which accepts only node types registered with pytree in this process
(never importing a module a file names, unlike ``treespec_loads``, whose enum hook imports one),
whose context is plain JSON or a registered namedtuple.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from .package import PackageError
from .tensorfile import TensorFileError, loads_json

SYMBOL = re.compile(r"[su]\d+")
_MAX_SPEC_NODES = 100_000


def _fail(msg: str) -> PackageError:
    return PackageError(f"invalid fxrt package: {msg}")


@dataclass(frozen=True)
class InputSig:
    """One graph input. ``kind``: ``weight`` (bound from the package's state by ``weight``
    name), ``tensor`` or ``constant`` (a leaf of the call at ``path``; a constant must equal
    ``value``), or ``symint`` (an int leaf whose value is the size expression ``shape[0]``)."""

    name: str
    kind: str
    path: str = ""
    weight: str = ""
    dtype: str = ""
    shape: tuple[int | str, ...] = ()
    device: str = ""
    value: Any = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kind": self.kind}
        if self.kind == "weight":
            d["weight"] = self.weight
        else:
            d["path"] = self.path
        if self.kind == "tensor":
            d.update(dtype=self.dtype, shape=list(self.shape), device=self.device)
        elif self.kind == "constant":
            d["value"] = self.value
        elif self.kind == "symint":
            d["shape"] = list(self.shape)
        return d

    def label(self) -> str:
        return f"input '{self.name}'" + (f" ({self.path})" if self.path else "")

    def describe(self, sig: Signature) -> str:
        dims = ", ".join(str(s) for s in self.shape)
        text = f"{self.dtype}[{dims}]" + ("" if self.device == "cpu" else f"@{self.device}")
        syms = [s for s in self.shape if isinstance(s, str) and s in sig.ranges]
        if syms:
            text += " with " + ", ".join(
                f"{sig.sym(s)} in {range_text(sig.ranges[s])}" for s in syms
            )
        return text


@dataclass(frozen=True)
class OutputSig:
    """One graph output: ``user`` (the ``index``-th leaf of the out spec, ``path`` in it),
    ``buffer_mutation`` (the new value of weight ``target``) or ``input_mutation`` (the new value
    of the graph input named ``target``, copied into the caller's tensor)."""

    kind: str
    path: str = ""
    target: str = ""
    dtype: str = ""
    shape: tuple[int | str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind}
        if self.kind == "user":
            d.update(path=self.path, dtype=self.dtype, shape=list(self.shape))
        else:
            d["target"] = self.target
        return d


@dataclass
class Signature:
    inputs: list[InputSig]
    outputs: list[OutputSig]
    ranges: dict[str, tuple[int, int | None]]
    in_spec: str
    out_spec: str
    dims: dict[str, str] = field(default_factory=dict)  # size symbol -> the user's Dim name

    def sym(self, s: str) -> str:
        """A size symbol as messages name it: ``batch (s77)``, or ``s77`` without a Dim name."""
        return f"{self.dims[s]} ({s})" if s in self.dims else s

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": [i.to_json() for i in self.inputs],
            "outputs": [o.to_json() for o in self.outputs],
            "ranges": {k: [lo, hi] for k, (lo, hi) in self.ranges.items()},
            "in_spec": self.in_spec,
            "out_spec": self.out_spec,
            "dims": self.dims,
        }

    @staticmethod
    def from_json(d: Any) -> Signature:
        if not isinstance(d, dict) or set(d) != {
            "inputs",
            "outputs",
            "ranges",
            "in_spec",
            "out_spec",
            "dims",
        }:
            raise _fail("signature: malformed")
        dims = _want(d["dims"], dict, "dims")
        if not all(
            SYMBOL.fullmatch(k) and isinstance(v, str) and len(v) <= 200 for k, v in dims.items()
        ):
            raise _fail("dims: malformed")
        ranges = {}
        for k, v in _want(d["ranges"], dict, "ranges").items():
            if not SYMBOL.fullmatch(k) or not isinstance(v, list) or len(v) != 2:
                raise _fail(f"ranges: malformed entry {k[:20]!r}")
            lo = _int(v[0], f"range of {k}")
            hi = None if v[1] is None else _int(v[1], f"range of {k}")
            if hi is not None and hi < lo:
                raise _fail(f"range of {k}: [{lo}, {hi}] is empty")
            ranges[k] = (lo, hi)
        inputs = [_input(x, i) for i, x in enumerate(_want(d["inputs"], list, "inputs"))]
        outputs = [_output(x, i) for i, x in enumerate(_want(d["outputs"], list, "outputs"))]
        return Signature(
            inputs,
            outputs,
            ranges,
            _want(d["in_spec"], str, "in_spec"),
            _want(d["out_spec"], str, "out_spec"),
            dims,
        )

    def user_inputs(self) -> list[InputSig]:
        return [i for i in self.inputs if i.kind != "weight"]


def range_text(r: tuple[int, int | None]) -> str:
    return f"[{r[0]}, {'inf' if r[1] is None else r[1]}]"


def _want(x: Any, typ: type, where: str) -> Any:
    if not isinstance(x, typ) or (typ is int and isinstance(x, bool)):
        raise _fail(f"{where}: expected {typ.__name__}, got {type(x).__name__}")
    return x


def _int(x: Any, where: str) -> int:
    if type(x) is not int or not -(2**62) <= x < 2**62:
        raise _fail(f"{where}: {str(x)[:20]} is not an integer in range")
    return x


def _str(d: dict[str, Any], key: str, where: str, limit: int = 4096) -> str:
    s = _want(d.get(key), str, f"{where} {key}")
    if len(s) > limit:
        raise _fail(f"{where} {key}: too long")
    return s


def _shape(x: Any, where: str) -> tuple[int | str, ...]:
    from ..serialize import SerializationError
    from ..serialize.format import _size_expr

    dims = _want(x, list, where)
    if len(dims) > 64:
        raise _fail(f"{where}: too many dimensions")
    try:
        return tuple(_size_expr(s, where) for s in dims)
    except SerializationError as e:
        raise _fail(str(e).removeprefix("invalid fxrt artifact: ")) from None


def _input(x: Any, i: int) -> InputSig:
    where = f"signature input {i}"
    d = _want(x, dict, where)
    kind = d.get("kind")
    keys = {
        "weight": {"name", "kind", "weight"},
        "tensor": {"name", "kind", "path", "dtype", "shape", "device"},
        "constant": {"name", "kind", "path", "value"},
        "symint": {"name", "kind", "path", "shape"},
    }.get(kind if isinstance(kind, str) else "")
    if keys is None or set(d) != keys:
        raise _fail(f"{where}: malformed")
    name = _str(d, "name", where)
    if kind == "weight":
        return InputSig(name, kind, weight=_str(d, "weight", where))
    path = _str(d, "path", where)
    if kind == "tensor":
        dtype = _str(d, "dtype", where, 40)
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise _fail(f"{where}: unknown dtype {dtype!r}")
        device = _str(d, "device", where, 40)
        try:
            torch.device(device)
        except RuntimeError:
            raise _fail(f"{where}: {device!r} is not a device") from None
        return InputSig(
            name, kind, path, dtype=dtype, shape=_shape(d["shape"], where), device=device
        )
    if kind == "constant":
        v = d["value"]
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise _fail(f"{where}: a constant must be a number, bool, string or null")
        return InputSig(name, kind, path, value=v)
    shape = _shape(d["shape"], where)
    if len(shape) != 1 or not isinstance(shape[0], str):
        raise _fail(f"{where}: a symint has one size expression")
    return InputSig(name, kind, path, shape=shape)


def _output(x: Any, i: int) -> OutputSig:
    where = f"signature output {i}"
    d = _want(x, dict, where)
    kind = d.get("kind")
    if kind == "user" and set(d) == {"kind", "path", "dtype", "shape"}:
        dtype = d["dtype"]
        if not isinstance(dtype, str) or len(dtype) > 40:
            raise _fail(f"{where}: malformed dtype")
        return OutputSig(kind, _str(d, "path", where), dtype=dtype, shape=_shape(d["shape"], where))
    if kind in ("buffer_mutation", "input_mutation") and set(d) == {"kind", "target"}:
        return OutputSig(kind, target=_str(d, "target", where))
    raise _fail(f"{where}: malformed")


# ----------------------------------------------------------------------------------------------
# Tree specs


def spec_to_json(spec: pytree.TreeSpec, what: str) -> str:
    """``spec`` as treespec JSON, checked to be readable by :func:`spec_from_json`.

    Raises:
        ValueError: a node type the package format cannot name (not registered with a serialized
            name, an enum in its context, a custom context reader).
    """
    try:
        text = pytree.treespec_dumps(spec)
    except (NotImplementedError, TypeError) as e:
        raise ValueError(f"fxrt.export: cannot store the {what} structure: {e}") from None
    try:
        spec_from_json(text, what)
    except PackageError as e:
        raise ValueError(f"fxrt.export: cannot store the {what} structure: {e}") from None
    return text


def spec_from_json(text: str, what: str) -> pytree.TreeSpec:
    """A TreeSpec from :func:`spec_to_json` text, validated; resolves types only through
    pytree's registry of this process.

    Raises:
        PackageError: malformed, or a type that is not registered (its name is in the message).
    """
    try:
        data = loads_json(text.encode(), f"{what} spec")
    except TensorFileError as e:
        raise _fail(str(e)) from None
    if not isinstance(data, list) or len(data) != 2 or data[0] != 1:
        raise _fail(f"{what} spec: unknown protocol")
    count = [0]
    try:
        return _node(data[1], what, count, 0)
    except RecursionError:
        raise _fail(f"{what} spec: nested too deeply") from None


def _node(d: Any, what: str, count: list[int], depth: int) -> pytree.TreeSpec:
    count[0] += 1
    if count[0] > _MAX_SPEC_NODES or depth > 100:
        raise _fail(f"{what} spec: too large")
    if not isinstance(d, dict) or set(d) != {"type", "context", "children_spec"}:
        raise _fail(f"{what} spec: malformed node")
    typ_name, ctx, children = d["type"], d["context"], d["children_spec"]
    if not isinstance(children, list):
        raise _fail(f"{what} spec: malformed children")
    if typ_name is None:
        if ctx is not None or children:
            raise _fail(f"{what} spec: malformed leaf")
        return pytree.treespec_leaf() if hasattr(pytree, "treespec_leaf") else pytree.LeafSpec()
    if not isinstance(typ_name, str):
        raise _fail(f"{what} spec: malformed type")
    typ = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(typ_name)
    if typ is None:
        raise PackageError(
            f"the package's {what} structure uses the type {typ_name[:120]!r}, which is not "
            "registered with torch.utils._pytree in this process: import the module that "
            "defines it before fxrt.load"
        )
    node_def = pytree.SUPPORTED_SERIALIZED_TYPES[typ]
    reader = node_def.from_dumpable_context
    if reader is None:
        if not isinstance(ctx, str):
            raise _fail(f"{what} spec: malformed context")
        try:
            context = loads_json(ctx.encode(), f"{what} spec context")
        except TensorFileError as e:
            raise _fail(str(e)) from None
        if "__enum__" in json.dumps(context):
            raise _fail(f"{what} spec: enum contexts are not supported")
    elif reader is pytree._namedtuple_deserialize:
        context = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(ctx) if isinstance(ctx, str) else None
        if context is None:
            raise PackageError(
                f"the package's {what} structure uses the namedtuple {str(ctx)[:120]!r}, which "
                "is not registered with torch.utils._pytree in this process"
            )
    else:
        raise _fail(f"{what} spec: the type {typ_name[:80]!r} needs its own context reader")
    kids = [_node(c, what, count, depth + 1) for c in children]
    if isinstance(context, list) and len(context) != len(kids) and typ in (dict,):
        raise _fail(f"{what} spec: {len(context)} keys for {len(kids)} children")
    try:
        return pytree.TreeSpec(typ, context, kids)
    except Exception as e:  # the TreeSpec constructor checks its own invariants
        raise _fail(f"{what} spec: {type(e).__name__}: {str(e)[:120]}") from None


def leaf_paths(spec: pytree.TreeSpec, top: Sequence[str] | None = None) -> list[str]:
    """A readable path per leaf of ``spec`` (``args[0]``, ``kwargs['mask']``, ``.logits``)."""
    try:
        tree = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
        paths = [p for p, _ in pytree.tree_flatten_with_path(tree)[0]]
    except Exception:
        return [f"[{i}]" for i in range(spec.num_leaves)]
    out = []
    for p in paths:
        if top is not None and p and isinstance(p[0], pytree.SequenceKey) and p[0].idx < len(top):
            out.append(top[p[0].idx] + pytree.keystr(p[1:]))
        else:
            out.append(pytree.keystr(p) or "output")
    return out


__all__ = [
    "InputSig",
    "OutputSig",
    "Signature",
    "leaf_paths",
    "spec_from_json",
    "spec_to_json",
]
