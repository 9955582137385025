"""Writing an artifact: a graph (and its pass records) as a JSON document and tensor records."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..artifact import ArtifactError, TensorRecord, encode_tensor
from ..ir.graph import Graph, Node, OpKind, Ref, TensorMeta
from .format import _PY_NAME, FORMAT, SerializationError, _check_python_args, _size_expr, versions


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
    if check_exprs:  # what decode_graph would refuse is not written
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


def dump_graph(graph: Graph, records: Sequence[Any] = ()) -> bytes:
    """A self-contained artifact (tensors inline) for ``graph``."""
    from ..artifact import pack

    doc, tensors = encode_graph(graph, records)
    return pack(doc, tensors)
