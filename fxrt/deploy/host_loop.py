"""A loaded package's graph on fxrt's own loops: what :class:`fxrt.deploy.LoadedModel` runs where
the C++ runtime's loop does not.

The runtime loads every package (structure, hashes, manifest, ops, weights, signature and stored
program validated; weights mapped) and makes every call's checks, weights and mutations
(``Model.run_on``). Its loop runs the stored program, except on the Python loop
(``pure_python``), for a program the runtime cannot run (a node that runs Python, several
streams, no stored program), under a profiler or a ``__torch_function__``, and for the IR a user
inspects (``graph``, ``program``, ``compiled``). For those, :func:`host_graph` builds the
package's graph as a :class:`fxrt.CompiledGraph`:

1. the graph (the manifest's ``graph``, its tensors the runtime's entries ``graph/<name>``) is
   decoded by :func:`fxrt.serialize.decode_graph`, which validates it as it does cache artifacts
   (ops only by name, Python fallbacks only from the pure-arithmetic allow-list, every id
   bounds-checked, the graph verified) and recomputes the lifetime plan; only the versions check
   differs (the runtime compared every op's schema);
2. every op it calls must be in the ops table the runtime checked; its inputs must be what the
   signature and the runtime's weights say;
3. it is lowered with the load's options; lowered with the package's, it must equal the stored
   program the runtime validated (on the export device), so that both loops run one program;
4. with ``device``, the graph's devices that are the export's become the load's first.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compiler import CompiledGraph
from ..config import CompilerConfig
from ..ir.graph import OpKind
from ..serialize import FORMAT as GRAPH_FORMAT
from ..serialize import SerializationError, decode_graph
from ..stage import lower_program
from .package import PackageError
from .program_data import encode_program, first_difference
from .tensorfile import loads_json


def _fail(msg: str) -> PackageError:
    return PackageError(f"invalid fxrt package: {msg}")


def manifest_fields(model: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """Manifest fields of a runtime-loaded ``model``, each parsed from its own text (the whole
    manifest only where a key is written with escapes)."""
    texts = {k: model._manifest_field(k) for k in keys}
    if all(texts.values()):
        return {k: loads_json(t, k) for k, t in texts.items()}
    m = loads_json(model._manifest_json(), "manifest")
    return {k: m.get(k) for k in keys}


def host_graph(model: Any, device: Any, config: CompilerConfig) -> CompiledGraph:
    """The package ``model`` (a LoadedModel) as a CompiledGraph lowered with ``config`` (see the
    module docstring). Raises PackageError where the graph is invalid or does not match the
    package."""
    try:
        return _host_graph(model, device, config)
    except PackageError:
        raise
    except SerializationError as e:
        raise _fail(str(e)[:400]) from None
    except Exception as e:  # whatever else a hostile graph provokes: one clean error
        raise _fail(f"{type(e).__name__}: {str(e)[:300]}") from e


def _host_graph(model: Any, device: Any, config: CompilerConfig) -> CompiledGraph:
    from ..artifact import decode_tensor

    m = manifest_fields(model, ("device", "graph", "ops", "program", "runtime_options"))
    exported = torch.device(m["device"])  # the runtime checked it
    target = exported if device is None else torch.empty(0, device=device).device
    doc = m["graph"]
    if not isinstance(doc, dict) or doc.get("format") != GRAPH_FORMAT:
        fmt = str(doc.get("format"))[:40] if isinstance(doc, dict) else "?"
        raise PackageError(
            f"the package's graph is in format {fmt!r}; this fxrt reads {GRAPH_FORMAT}"
        )
    if target != exported:
        doc = _retarget(doc, exported, target)

    def fetch(name: str, record: Any) -> torch.Tensor:
        data = model._entry_bytes(f"graph/{name}")
        if not data and record.nbytes:
            raise _fail(f"graph tensor {name[:60]!r} has no entry")
        return decode_tensor(record, data)

    graph, plan, records, _ = decode_graph(doc, fetch, check_versions=False)
    del doc, m["graph"]
    for node in graph.nodes:
        if node.op.kind is OpKind.ATEN and node.op.name not in m["ops"]:
            raise _fail(f"node {node.name} calls {node.op.name}, which the ops table lacks")
    _check_inputs(model, graph)
    program = lower_program(graph, plan, config)
    if m["program"] is not None and target == exported:
        stored = CompilerConfig.from_options(None, {**m["runtime_options"], "cache": False})
        same = (stored.arena, stored.check_inputs) == (config.arena, config.check_inputs)
        _check_program(m["program"], program if same else lower_program(graph, plan, stored))
    cg = CompiledGraph(graph, plan, program, config)
    cg.pass_records = records
    return cg


def _check_inputs(model: Any, graph: Any) -> None:
    """The graph's inputs are the signature's: weights (the runtime's) and user tensors with the
    geometry the graph was compiled for."""
    sig = model.signature
    if len(sig.inputs) != len(graph.inputs):
        raise _fail(f"{len(sig.inputs)} signature inputs for {len(graph.inputs)} graph inputs")
    weights = model.state_dict()
    for s, vid in zip(sig.inputs, graph.inputs):
        value = graph.values[vid]
        meta = value.meta
        if s.kind == "weight":
            t = weights[s.weight]
            if meta is None or (tuple(t.shape), tuple(t.stride()), t.dtype) != (
                meta.shape,
                meta.stride,
                meta.dtype,
            ):
                raise _fail(f"weight {s.weight[:60]!r} does not match graph input {value.name}")
        elif s.kind == "tensor":
            if meta is None or (meta.shape, str(meta.dtype).removeprefix("torch.")) != (
                s.shape,
                s.dtype,
            ):
                raise _fail(f"input {s.name[:60]!r} does not match graph input {value.name}")


def _check_program(stored: Any, program: Any) -> None:
    """The stored program (what the C++ runtime runs) must be the one lowered from the graph."""
    try:
        ours = encode_program(program)
    except SerializationError:
        ours = None
    if ours != stored:
        where = first_difference(stored, ours)
        raise _fail(f"the stored program differs from the graph's ({str(where)[:120]})")


def _retarget(doc: Any, old: torch.device, new: torch.device) -> Any:
    """The graph document with every device that is the export's replaced by ``new``."""

    def same(s: str) -> bool:
        try:
            d = torch.device(s)
        except RuntimeError:
            return False
        return d == old or (d.type == old.type and d.index is None)

    def walk(x: Any, depth: int = 0) -> Any:
        if depth > 200:
            raise _fail("graph nested too deeply")
        if isinstance(x, dict):
            return {
                k: str(new)
                if k == "device" and isinstance(v, str) and same(v)
                else walk(v, depth + 1)
                for k, v in x.items()
            }
        if isinstance(x, list):
            return [walk(v, depth + 1) for v in x]
        return x

    return walk(doc)


__all__ = ["host_graph", "manifest_fields"]
