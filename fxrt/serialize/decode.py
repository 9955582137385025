"""Reading an artifact: every field checked before it is used, the graph verified, its plan
recomputed (never read from the file)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..artifact import ArtifactError, TensorRecord, decode_tensor
from ..exec.plan import Plan, plan_lifetimes
from ..ir.graph import Graph, Node, Op, OpKind, Ref, TensorMeta, Value, ValueKind
from ..ir.verify import VerificationError, verify
from ..records import PassRecord
from .format import (
    _DTYPES,
    _FORMATS,
    _LAYOUTS,
    FORMAT,
    PYTHON_FALLBACKS,
    SerializationError,
    _check_python_args,
    _fail,
    _int,
    _size_expr,
    _want,
    versions,
)


def _meta(m: Any, where: str) -> TensorMeta | None:
    if m is None:
        return None
    _want(m, dict, where)
    if set(m) != {"shape", "stride", "dtype", "device", "nbytes"}:
        raise _fail(f"{where}: unexpected tensor metadata fields {sorted(m)}")
    shape = tuple(_size_expr(s, f"{where} shape") for s in _want(m["shape"], list, where))
    stride = tuple(_size_expr(s, f"{where} stride") for s in _want(m["stride"], list, where))
    if len(shape) != len(stride):
        raise _fail(f"{where}: {len(shape)} sizes but {len(stride)} strides")
    dtype = _DTYPES.get(_want(m["dtype"], str, where))
    if dtype is None:
        raise _fail(f"{where}: unknown dtype {m['dtype']!r}")
    device = _device(m["device"], where)
    nbytes = None if m["nbytes"] is None else _size_expr(m["nbytes"], f"{where} nbytes")
    return TensorMeta(shape, stride, dtype, str(device), nbytes)


def _device(x: Any, where: str) -> torch.device:
    try:
        return torch.device(_want(x, str, where))
    except RuntimeError:
        raise _fail(f"{where}: {x[:40]!r} is not a device") from None


class _Reader:
    def __init__(
        self,
        doc: dict[str, Any],
        fetch: Callable[[str, TensorRecord], torch.Tensor],
        caller_constants: Sequence[Any] | None,
    ) -> None:
        self.doc = doc
        self.fetch = fetch
        self.caller = caller_constants
        records = _want(doc.get("tensors", {}), dict, "tensors")
        self.records = {
            _want(k, str, "tensor name"): TensorRecord.from_json(v, f"tensor {k}")
            for k, v in records.items()
        }
        self.n_values = 0
        # Stack traces repeat (a model's layers share their source lines) and JSON gives each
        # node its own copy: the graph keeps one string per distinct trace.
        self.traces: dict[str, str] = {}

    def ref(self, v: Any, where: str) -> Ref:
        return Ref(_int(v, where, 0, self.n_values - 1))

    def arg(self, a: Any, where: str, depth: int = 0) -> Any:
        if depth > 32:
            raise _fail(f"{where}: nested too deeply")
        if a is None or isinstance(a, (bool, int, str)):
            return a
        if isinstance(a, float):
            return a
        if not isinstance(a, dict) or len(a) != 1:
            raise _fail(f"{where}: malformed argument {str(a)[:60]}")
        ((tag, v),) = a.items()
        sub = lambda x: self.arg(x, where, depth + 1)  # noqa: E731
        if tag == "ref":
            return self.ref(v, where)
        if tag == "list":
            return [sub(x) for x in _want(v, list, where)]
        if tag == "tuple":
            return tuple(sub(x) for x in _want(v, list, where))
        if tag == "dict":
            return {_want(k, str, where): sub(x) for k, x in _want(v, dict, where).items()}
        if tag == "slice":
            if len(_want(v, list, where)) != 3:
                raise _fail(f"{where}: a slice has 3 fields")
            return slice(*(sub(x) for x in v))
        if tag == "float":
            if v not in ("inf", "-inf", "nan"):
                raise _fail(f"{where}: {str(v)[:20]!r} is not a float")
            return float(v)
        if tag == "device":
            return _device(v, where)
        table = {"dtype": _DTYPES, "layout": _LAYOUTS, "memory_format": _FORMATS}.get(tag)
        if table is not None:
            if not isinstance(v, str) or v not in table:
                raise _fail(f"{where}: unknown {tag} {str(v)[:40]!r}")
            return table[v]
        if tag == "tensor":
            record = self.records.get(_want(v, str, where))
            if record is None:
                raise _fail(f"{where}: no tensor named {v[:40]!r}")
            return self.fetch(v, record)
        raise _fail(f"{where}: unknown argument tag {str(tag)[:40]!r}")

    def constant(self, a: Any, where: str) -> Any:
        if isinstance(a, dict) and set(a) == {"caller"}:
            if self.caller is None:
                raise _fail(f"{where}: refers to a constant of the graph it was cached for")
            i = _int(a["caller"], where, 0)
            if i >= len(self.caller):
                raise _fail(f"{where}: caller constant {i} out of range ({len(self.caller)})")
            return self.caller[i]
        return self.arg(a, where)

    def graph(self) -> tuple[Graph, list[Any], list[int | None]]:
        doc = self.doc
        g = Graph()
        for vid, v in enumerate(_want(doc["values"], list, "values")):
            where = f"value {vid}"
            if not isinstance(v, list) or len(v) != 4:
                raise _fail(f"{where}: malformed")
            name, kind, meta, expr = v
            try:
                kind = ValueKind(kind)
            except ValueError:
                raise _fail(f"{where}: unknown kind {str(kind)[:20]!r}") from None
            expr = None if expr is None else _size_expr(expr, f"{where} expression")
            g.values.append(Value(vid, _want(name, str, where), kind, _meta(meta, where), expr))
        self.n_values = len(g.values)
        g.inputs = [self.ref(v, "input").id for v in _want(doc["inputs"], list, "inputs")]
        for item in _want(doc["constants"], list, "constants"):
            if not isinstance(item, list) or len(item) != 2:
                raise _fail("constants: malformed entry")
            vid = self.ref(item[0], "constant").id
            where = f"constant {g.values[vid].name}"
            c = self.constant(item[1], where)
            _check_constant(g.values[vid], c, where)
            g.constants[vid] = c
        traces: list[int | None] = []
        for i, n in enumerate(_want(doc["nodes"], list, "nodes")):
            _want(n, dict, f"node {i}")
            keys = {"name", "op", "args", "kwargs", "outputs", "multi", "copies", "stack_trace"}
            if set(n) != keys | {"trace_from"}:
                raise _fail(f"node {i}: unexpected fields {sorted(n)}")
            name = _want(n["name"], str, f"node {i} name")
            where = f"node {name}"
            op = _op(_want(n["op"], dict, where), where)
            args = self.arg(n["args"], where)
            kwargs = self.arg(n["kwargs"], where)
            if not isinstance(args, tuple) or not isinstance(kwargs, dict):
                raise _fail(f"{where}: arguments must be a tuple and a dict")
            outputs = [self.ref(v, f"{where} output").id for v in _want(n["outputs"], list, where)]
            trace = n["stack_trace"]
            node = Node(
                name,
                op,
                args,
                kwargs,
                outputs,
                multi=_want(n["multi"], bool, where),
                stack_trace=None
                if trace is None
                else self.traces.setdefault(_want(trace, str, where), trace),
                copies=_want(n["copies"], bool, where),
            )
            if op.kind is OpKind.PYTHON:
                _check_python_args(g, node)
            g.nodes.append(node)
            tf = n["trace_from"]
            traces.append(None if tf is None else _int(tf, f"{where} trace_from", 0))
        g.output = self.arg(doc["output"], "graph output")
        records = []
        for r in _want(doc["passes"], list, "passes"):
            if not isinstance(r, list) or len(r) != 3:
                raise _fail("passes: malformed record")
            records.append(
                PassRecord(
                    _want(r[0], str, "pass"),
                    float(_want(r[1], (int, float), "pass")),
                    _want(r[2], bool, "pass"),
                )
            )
        try:
            verify(g)
        except VerificationError as e:
            raise _fail(str(e)) from None
        return g, records, traces


def _op(spec: dict[str, Any], where: str) -> Op:
    if set(spec) == {"aten"}:
        return Op.of(resolve_op(_want(spec["aten"], str, where)))
    if set(spec) == {"python"}:
        name = spec["python"]
        if name not in PYTHON_FALLBACKS:
            raise _fail(f"{where}: {str(name)[:60]!r} is not an allowed Python fallback")
        return Op(OpKind.PYTHON, PYTHON_FALLBACKS[name], name)
    raise _fail(f"{where}: malformed op {str(spec)[:60]}")


def _check_constant(value: Value, c: Any, where: str) -> None:
    """A tensor constant must be what the graph's metadata says it is."""
    if value.kind is not ValueKind.TENSOR or value.meta is None:
        if isinstance(c, torch.Tensor):
            raise _fail(f"{where}: a tensor where the graph has a {value.kind.value}")
        return
    m = value.meta
    if not isinstance(c, torch.Tensor):
        raise _fail(f"{where}: a {type(c).__name__} where the graph has a tensor")
    got = (tuple(c.shape), tuple(c.stride()), c.dtype, c.device)
    want = (m.shape, m.stride, m.dtype, torch.device(m.device))
    if got != want:
        raise _fail(f"{where}: tensor {got} does not match its metadata {want}")


def resolve_op(name: str) -> torch._ops.OpOverload:
    """``"aten::add.Tensor"`` -> ``torch.ops.aten.add.Tensor``, through ``torch.ops`` only."""
    ns, sep, rest = name.partition("::")
    base, _, overload = rest.partition(".")
    ident = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
    if not sep or not all(ident.fullmatch(p) for p in (ns, base, overload or "default")):
        raise SerializationError(f"invalid fxrt artifact: {name[:80]!r} is not an op name")
    try:
        op = getattr(getattr(getattr(torch.ops, ns), base), overload or "default")
    except (AttributeError, RuntimeError) as e:
        raise SerializationError(f"op {name} is not registered in this process") from e
    if not isinstance(op, torch._ops.OpOverload):
        raise SerializationError(f"invalid fxrt artifact: {name[:80]!r} is not an op")
    return op


def decode_graph(
    doc: Any,
    fetch: Callable[[str, TensorRecord], torch.Tensor],
    caller_constants: Sequence[Any] | None = None,
    *,
    check_versions: bool = True,
) -> tuple[Graph, Plan, list[Any], list[int | None]]:
    """Rebuild and validate a graph from an artifact document; recompute its plan.

    ``check_versions=False`` skips only the check that the document was made by this exact fxrt
    and torch (a package's loader checks its ops by schema instead); it also skips computing
    :func:`versions`, whose source hash reads all of fxrt's files (a few ms and half a MiB of
    transient reads, once per process).

    Returns:
        The graph, its lifetime plan (recomputed), the pass records, and per node the index of
        the caller's node whose source line it carries (or None).

    Raises:
        SerializationError: the document is not a valid artifact of this format and versions.
    """
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SerializationError(f"not an {FORMAT} artifact")
    if check_versions and doc.get("versions") != versions():
        raise SerializationError(
            f"artifact was made by {doc.get('versions')}, this is {versions()}"
        )
    try:
        graph, records, traces = _Reader(doc, fetch, caller_constants).graph()
        return graph, plan_lifetimes(graph), records, traces
    except SerializationError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, RecursionError, ArtifactError) as e:
        raise _fail(f"{type(e).__name__}: {e}") from e


def load_graph(data: bytes) -> tuple[Graph, Plan, list[Any]]:
    """Rebuild a graph from :func:`dump_graph` bytes, loading only data.

    Raises:
        SerializationError: not an fxrt artifact of this format and these versions, or corrupt.
    """
    from ..artifact import unpack

    try:
        doc, section = unpack(data)
    except ArtifactError as e:
        raise SerializationError(f"not a valid fxrt artifact: {e}") from None
    graph, plan, records, _ = decode_graph(doc, lambda _n, r: decode_tensor(r, section.read(r)))
    return graph, plan, records
