"""Data-only serialization of compiled graphs (``dump_artifacts`` / ``load_artifacts``, pickle,
the on-disk cache).

An artifact is one ``torch.save`` file holding only a JSON string and a flat dict of tensors, so
it loads with ``torch.load(weights_only=True)``: nothing in it can run code. The JSON holds the
format version, the fxrt and torch versions, the IR (values, inputs, nodes, output), the plan, and
constants by reference. Ops are stored by their schema names (``aten::add.Tensor``) and resolved
through ``torch.ops`` on load; Python fallbacks are stored only if they are among a fixed set of
known callables (``operator.*``, ``math.*``, ``torch.sym_*``, higher-order ops by name).
"""

from __future__ import annotations

import gc
import io
import json
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch

from .exec.plan import Plan
from .ir.graph import Graph, Node, Op, OpKind, Ref, TensorMeta, Value, ValueKind

FORMAT = "fxrt-artifact/1"


class SerializationError(ValueError):
    """A graph holds something the data-only format cannot represent, or an artifact is invalid."""


def _python_callables() -> dict[str, Any]:
    table: dict[str, Any] = {}
    for name in dir(operator):
        fn = getattr(operator, name)
        if callable(fn) and not name.startswith("_"):
            table[f"operator.{name}"] = fn
    for name in ("floor", "ceil", "trunc", "sqrt"):
        table[f"math.{name}"] = getattr(math, name)
    for name in ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_sqrt", "sym_ite"):
        if hasattr(torch, name):
            table[f"torch.{name}"] = getattr(torch, name)
    return table


_PY = _python_callables()
_PY_NAME = {id(fn): name for name, fn in _PY.items()}
_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {str(x): x for x in vars(torch).values() if isinstance(x, torch.layout)}
_FORMATS = {str(x): x for x in vars(torch).values() if isinstance(x, torch.memory_format)}


class _Writer:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def tensor(self, t: torch.Tensor) -> str:
        key = f"t{len(self.tensors)}"
        self.tensors[key] = t.detach()
        return key

    def arg(self, a: Any, where: str) -> Any:
        if a is None or isinstance(a, (bool, str)):
            return a
        if isinstance(a, int):
            return a
        if isinstance(a, float):
            return a if math.isfinite(a) else {"float": repr(a)}
        if isinstance(a, Ref):
            return {"ref": a.id}
        if isinstance(a, list):
            return {"list": [self.arg(x, where) for x in a]}
        if isinstance(a, tuple):
            return {"tuple": [self.arg(x, where) for x in a]}
        if isinstance(a, dict):
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
            return {"tensor": self.tensor(a)}
        raise SerializationError(f"{where}: cannot serialize a {type(a).__name__} ({a!r:.60})")

    def op(self, node: Node) -> dict[str, Any]:
        if node.op.kind is OpKind.ATEN:
            return {"aten": node.op.name}
        target = node.op.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            raise SerializationError(
                f"node {node.name}: higher-order op {target.name()} holds Python subgraphs"
            )
        name = _PY_NAME.get(id(target))
        if name is None:
            raise SerializationError(
                f"node {node.name}: Python callable {node.op.name} is not one the data-only "
                "format can name"
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


def dump_graph(graph: Graph, plan: Plan, records: Sequence[Any] = ()) -> bytes:
    """Serialize a graph, its plan and its pass records to artifact bytes."""
    w = _Writer()
    constants = {}
    for vid, c in graph.constants.items():
        constants[str(vid)] = w.arg(c, f"constant {graph.values[vid].name}")
    doc = {
        "format": FORMAT,
        "versions": versions(),
        "values": [[v.name, v.kind.value, _meta_json(v.meta), v.expr] for v in graph.values],
        "inputs": graph.inputs,
        "constants": constants,
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
            }
            for n in graph.nodes
        ],
        "output": w.arg(graph.output, "graph output"),
        "passes": [[r.name, r.seconds, r.changed] for r in records],
        "plan": {
            "last_use": plan.last_use,
            "alias_root": plan.alias_root,
            "pinned": sorted(plan.pinned),
            "frees": plan.frees,
            "roots": sorted(plan.roots),
            "live_bytes": plan.live_bytes,
            "peak_bytes": plan.peak_bytes,
            "exact": plan.exact,
            "symbolic": plan.symbolic,
        },
    }
    buf = io.BytesIO()
    torch.save({"json": json.dumps(doc), "tensors": w.tensors}, buf)
    return buf.getvalue()


def versions() -> dict[str, str]:
    from . import __version__
    from .cache import source_hash

    return {"fxrt": __version__, "fxrt_source": source_hash(), "torch": torch.__version__}


def load_graph(data: bytes) -> tuple[Graph, Plan, list[Any]]:
    """Rebuild a graph, its plan and its pass records from artifact bytes, loading only data.

    Raises:
        SerializationError: the bytes are not an fxrt artifact of this format and these versions,
            or they are corrupt.
    """
    try:
        blob = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        doc = json.loads(blob["json"])
        tensors = blob["tensors"]
    except Exception as e:
        raise SerializationError(f"not a valid fxrt artifact: {type(e).__name__}: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SerializationError(f"not an {FORMAT} artifact")
    if doc.get("versions") != versions():
        raise SerializationError(
            f"artifact was made by {doc.get('versions')}, this is {versions()}"
        )
    # Rebuilding allocates thousands of small objects; in a process that holds Dynamo's state a
    # full garbage collection triggered here costs far more than the rebuild itself.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _rebuild(doc, tensors)
    except SerializationError:
        raise
    except Exception as e:
        raise SerializationError(f"corrupt fxrt artifact: {type(e).__name__}: {e}") from e
    finally:
        if was_enabled:
            gc.enable()


def _arg(a: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(a, dict):
        return a
    ((tag, v),) = a.items()
    if tag == "ref":
        return Ref(int(v))
    if tag == "list":
        return [_arg(x, tensors) for x in v]
    if tag == "tuple":
        return tuple(_arg(x, tensors) for x in v)
    if tag == "dict":
        return {k: _arg(x, tensors) for k, x in v.items()}
    if tag == "slice":
        return slice(*(_arg(x, tensors) for x in v))
    if tag == "float":
        return float(v)
    if tag == "dtype":
        return _DTYPES[v]
    if tag == "device":
        return torch.device(v)
    if tag == "layout":
        return _LAYOUTS[v]
    if tag == "memory_format":
        return _FORMATS[v]
    if tag == "tensor":
        return tensors[v]
    raise SerializationError(f"unknown argument tag {tag!r}")


def resolve_op(name: str) -> torch._ops.OpOverload:
    """``"aten::add.Tensor"`` -> ``torch.ops.aten.add.Tensor``."""
    ns, _, rest = name.partition("::")
    base, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, ns), base), overload or "default")
    except (AttributeError, RuntimeError) as e:
        raise SerializationError(f"op {name} is not registered in this process") from e


def _rebuild(doc: dict, tensors: dict[str, torch.Tensor]) -> tuple[Graph, Plan, list[Any]]:
    g = Graph()
    for vid, (name, kind, meta, expr) in enumerate(doc["values"]):
        tm = None
        if meta is not None:
            tm = TensorMeta(
                tuple(meta["shape"]),
                tuple(meta["stride"]),
                _DTYPES[meta["dtype"]],
                meta["device"],
                meta["nbytes"],
            )
        g.values.append(Value(vid, name, ValueKind(kind), tm, expr))
    g.inputs = [int(v) for v in doc["inputs"]]
    g.constants = {int(k): _arg(v, tensors) for k, v in doc["constants"].items()}
    for n in doc["nodes"]:
        if "aten" in n["op"]:
            op = Op.of(resolve_op(n["op"]["aten"]))
        else:
            name = n["op"]["python"]
            if name not in _PY:
                raise SerializationError(f"unknown Python callable {name!r}")
            op = Op(OpKind.PYTHON, _PY[name], name)
        g.nodes.append(
            Node(
                n["name"],
                op,
                _arg(n["args"], tensors),
                _arg(n["kwargs"], tensors),
                [int(v) for v in n["outputs"]],
                multi=bool(n["multi"]),
                stack_trace=n["stack_trace"],
                copies=bool(n["copies"]),
            )
        )
    g.output = _arg(doc["output"], tensors)
    p = doc["plan"]
    plan = Plan(
        last_use=tuple(p["last_use"]),
        alias_root=tuple(p["alias_root"]),
        pinned=frozenset(p["pinned"]),
        frees=tuple(tuple(f) for f in p["frees"]),
        roots=frozenset(p["roots"]),
        live_bytes=tuple(p["live_bytes"]),
        peak_bytes=int(p["peak_bytes"]),
        exact=bool(p["exact"]),
        symbolic=bool(p["symbolic"]),
    )
    from .passes import PassRecord

    records = [PassRecord(str(n), float(t), bool(c)) for n, t, c in doc["passes"]]
    return g, plan, records
