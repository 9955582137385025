"""Data-only serialization of compiled graphs (``dump_artifacts`` / ``load_artifacts``, pickle,
the on-disk cache).

An artifact is a closed format that loads without running code and without trusting the file:

* The container (:mod:`fxrt.artifact`) is a magic line, the SHA-256 of the rest, a JSON
  document and raw tensor bytes. No pickle, no ``torch.load``: a flipped bit is caught by the hash
  before anything is parsed.
* The document holds the IR (values, inputs, constants, nodes, output) and the pass records.
  Ops are stored by qualified name (``aten::add.Tensor``) and resolved through ``torch.ops`` only.
  Python fallbacks are limited to a fixed allow-list of pure arithmetic and comparison on SymInts
  and Python scalars (:data:`PYTHON_FALLBACKS`): no attribute access, no calls of values, no
  strings as callables, and their arguments must be scalar values or numbers.
* Every field is type-checked, every value id bounds-checked, symbolic size expressions must be
  arithmetic over size symbols (they are later read by sympy), constants must match their
  metadata, and the graph is verified. The lifetime plan, the arena and the program are never
  read from the file: they are recomputed from the graph.
* A constant is stored either as tensor bytes or, for the cache, as a reference to the caller's
  own constant (``{"caller": i}``): a model's parameters and buffers stay the live objects the
  caller holds, on a hit as on a miss.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .artifact import ArtifactError, TensorRecord, decode_tensor, encode_tensor
from .exec.plan import Plan, plan_lifetimes
from .fingerprint import source_hash
from .ir.graph import Graph, Node, Op, OpKind, Ref, TensorMeta, Value, ValueKind
from .ir.verify import VerificationError, verify
from .passes import PassRecord

FORMAT = "fxrt-artifact/2"


class SerializationError(ValueError):
    """A graph holds something the data-only format cannot represent, or an artifact is invalid."""


# Pure arithmetic and comparison: the only Python callables an artifact may name.
_OPERATORS = (
    "add sub mul truediv floordiv mod pow neg pos abs eq ne lt le gt ge "
    "and_ or_ xor not_ invert truth lshift rshift"
).split()
PYTHON_FALLBACKS: dict[str, Any] = {f"operator.{n}": getattr(operator, n) for n in _OPERATORS}
PYTHON_FALLBACKS.update({f"math.{n}": getattr(math, n) for n in ("floor", "ceil", "trunc", "sqrt")})
for _n in ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_sqrt", "sym_ite"):
    if hasattr(torch, _n):
        PYTHON_FALLBACKS[f"torch.{_n}"] = getattr(torch, _n)
_PY_NAME = {id(fn): name for name, fn in PYTHON_FALLBACKS.items()}
_SCALAR_KINDS = (ValueKind.SYM, ValueKind.SCALAR)

_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {str(x): x for x in vars(torch).values() if isinstance(x, torch.layout)}
_FORMATS = {str(x): x for x in vars(torch).values() if isinstance(x, torch.memory_format)}
# A symbolic size as fxrt prints it (``4*s0*s1``, ``Max(1, s0)``, ``(s0//2)``): size symbols, a
# few sympy functions, integers and arithmetic. Anything else could make sympy evaluate code.
_SYMBOL = re.compile(r"[su]\d+|Max|Min|floor|ceiling|FloorDiv|CeilDiv|Mod|PythonMod|Abs")
_EXPR = re.compile(r"[A-Za-z0-9_ +\-*/(),%.]{1,2000}")


# ----------------------------------------------------------------------------------------------
# Writing


class _Writer:
    def __init__(self, caller_constants: Sequence[Any]) -> None:
        self.tensors: dict[str, TensorRecord] = {}
        self.caller = {id(c): i for i, c in enumerate(caller_constants)}

    def constant(self, c: Any, where: str) -> Any:
        if isinstance(c, torch.Tensor) and id(c) in self.caller:
            return {"caller": self.caller[id(c)]}
        return self.arg(c, where)

    def arg(self, a: Any, where: str) -> Any:
        if a is None or isinstance(a, (bool, str, int)):
            return a
        if isinstance(a, float):
            return a if math.isfinite(a) else {"float": repr(a)}
        if isinstance(a, Ref):
            return {"ref": a.id}
        if isinstance(a, list):
            return {"list": [self.arg(x, where) for x in a]}
        if isinstance(a, tuple):
            return {"tuple": [self.arg(x, where) for x in a]}
        if isinstance(a, dict) and all(isinstance(k, str) for k in a):
            return {"dict": {k: self.arg(v, where) for k, v in a.items()}}
        if isinstance(a, slice):
            return {"slice": [self.arg(x, where) for x in (a.start, a.stop, a.step)]}
        if isinstance(a, torch.dtype):
            return {"dtype": str(a)}
        if isinstance(a, torch.device):
            return {"device": str(a)}
        if isinstance(a, torch.layout):
            return {"layout": str(a)}
        if isinstance(a, torch.memory_format):
            return {"memory_format": str(a)}
        if isinstance(a, torch.Tensor):
            try:
                record = encode_tensor(a)
            except ArtifactError as e:
                raise SerializationError(f"{where}: cannot serialize a tensor: {e}") from None
            name = f"t{len(self.tensors)}"
            self.tensors[name] = record
            return {"tensor": name}
        raise SerializationError(f"{where}: cannot serialize a {type(a).__name__} ({a!r:.60})")

    def op(self, node: Node) -> dict[str, Any]:
        if node.op.kind is OpKind.ATEN:
            return {"aten": node.op.name}
        target = node.op.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            raise SerializationError(
                f"node {node.name}: cannot serialize higher-order op {target.name()}: it holds "
                "Python subgraphs"
            )
        name = _PY_NAME.get(id(target))
        if name is None:
            raise SerializationError(
                f"node {node.name}: cannot serialize Python callable {node.op.name}: the "
                "data-only format names only pure arithmetic"
            )
        return {"python": name}


def _meta_json(m: TensorMeta | None) -> Any:
    if m is None:
        return None
    return {
        "shape": list(m.shape),
        "stride": list(m.stride),
        "dtype": str(m.dtype),
        "device": m.device,
        "nbytes": m.storage_nbytes,
    }


def encode_graph(
    graph: Graph,
    records: Sequence[Any] = (),
    caller_constants: Sequence[Any] = (),
    traces_from: Sequence[int | None] | None = None,
    *,
    check_exprs: bool = False,
) -> tuple[dict[str, Any], dict[str, TensorRecord]]:
    """The document and tensors of an artifact for ``graph``.

    Args:
        graph: the compiled graph.
        records: its pass records.
        caller_constants: constants the loader will hand back (the cache's key graph's): a graph
            constant that *is* one of them is stored as a reference, not as bytes.
        traces_from: per node, the index of the caller's node whose source line it carries (the
            loader takes that node's current line), or None.
        check_exprs: refuse symbolic value expressions :func:`decode_graph` would refuse (for
            what :func:`decode_graph` reads back: cache entries, precompile bytes; a package's
            loader reads its program's own arithmetic).

    Raises:
        SerializationError: the graph holds something the format cannot name.
    """
    w = _Writer(caller_constants)
    if check_exprs:  # what decode_graph would refuse is not written (e.g. ToFloat(s0))
        for v in graph.values:
            if v.expr is not None:
                _size_expr(v.expr, f"value {v.name} expression")
    for node in graph.nodes:
        if node.op.kind is OpKind.PYTHON:
            w.op(node)  # names the op, or says why it cannot
            _check_python_args(graph, node)
    doc = {
        "format": FORMAT,
        "versions": versions(),
        "values": [[v.name, v.kind.value, _meta_json(v.meta), v.expr] for v in graph.values],
        "inputs": graph.inputs,
        "constants": [
            [vid, w.constant(c, f"constant {graph.values[vid].name}")]
            for vid, c in graph.constants.items()
        ],
        "nodes": [
            {
                "name": n.name,
                "op": w.op(n),
                "args": w.arg(n.args, f"node {n.name}"),
                "kwargs": w.arg(n.kwargs, f"node {n.name}"),
                "outputs": n.outputs,
                "multi": n.multi,
                "copies": n.copies,
                "stack_trace": n.stack_trace,
                "trace_from": traces_from[i] if traces_from else None,
            }
            for i, n in enumerate(graph.nodes)
        ],
        "output": w.arg(graph.output, "graph output"),
        "passes": [[r.name, r.seconds, r.changed] for r in records],
    }
    return doc, w.tensors


def versions() -> dict[str, str]:
    """What an artifact (and a cache key) was made by: fxrt's version and the hash of its
    sources (:func:`fxrt.fingerprint.source_hash`), and torch's version."""
    from . import __version__

    return {"fxrt": __version__, "fxrt_source": source_hash(), "torch": torch.__version__}


# ----------------------------------------------------------------------------------------------
# Reading: every field checked before it is used


def _fail(msg: str) -> SerializationError:
    return SerializationError(f"invalid fxrt artifact: {msg}")


def _want(x: Any, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(x, typ) or (typ is int and isinstance(x, bool)):
        names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise _fail(f"{where}: expected {names}, got {type(x).__name__}")
    return x


def _int(x: Any, where: str, lo: int = -(2**63), hi: int = 2**63 - 1) -> int:
    _want(x, int, where)
    if isinstance(x, bool) or not lo <= x <= hi:
        raise _fail(f"{where}: {x!r} is out of range [{lo}, {hi}]")
    return x


def _size_expr(x: Any, where: str) -> int | str:
    if isinstance(x, int) and not isinstance(x, bool):
        return _int(x, where, 0)
    _want(x, str, where)
    if not _EXPR.fullmatch(x) or any(
        not _SYMBOL.fullmatch(tok) for tok in re.findall(r"[A-Za-z_]\w*", x)
    ):
        raise _fail(f"{where}: {x[:60]!r} is not a size expression")
    return x


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


def _check_python_args(graph: Graph, node: Node) -> None:
    """A Python fallback computes on SymInts and Python numbers only."""
    if node.kwargs or not all(
        (isinstance(a, Ref) and graph.values[a.id].kind in _SCALAR_KINDS)
        or (isinstance(a, (int, float, bool)) and not isinstance(a, Ref))
        for a in node.args
    ):
        raise SerializationError(
            f"node {node.name}: Python fallback {node.op.name} must take SymInts and numbers only"
        )


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


def dump_graph(graph: Graph, records: Sequence[Any] = ()) -> bytes:
    """A self-contained artifact (tensors inline) for ``graph``."""
    from .artifact import pack

    doc, tensors = encode_graph(graph, records)
    return pack(doc, tensors)


def load_graph(data: bytes) -> tuple[Graph, Plan, list[Any]]:
    """Rebuild a graph from :func:`dump_graph` bytes, loading only data.

    Raises:
        SerializationError: not an fxrt artifact of this format and these versions, or corrupt.
    """
    from .artifact import unpack

    try:
        doc, section = unpack(data)
    except ArtifactError as e:
        raise SerializationError(f"not a valid fxrt artifact: {e}") from None
    graph, plan, records, _ = decode_graph(doc, lambda _n, r: decode_tensor(r, section.read(r)))
    return graph, plan, records
