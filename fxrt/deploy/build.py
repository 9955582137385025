"""``fxrt.export``: a model to a :class:`Package` (``pkg.save("model.fxrt")``), without Dynamo.

1. ``torch.export.export`` traces the model (non-strict by default) on the example inputs, with
   the ``dynamic_shapes`` the caller gives (``torch.export.Dim``).
2. ``run_decompositions`` with the CompositeImplicitAutograd decompositions only: the graph is
   functional ATen with the same ops ``make_fx`` gives fxrt's ``torch.compile`` backend
   (``linear`` -> ``t`` + ``addmm``, ``layer_norm`` -> ``native_layer_norm``), not core ATen,
   whose decompositions would split ops fxrt runs well as they are. Mutations of buffers and
   inputs become extra graph outputs, which the loaded model copies back, as ``torch.export``'s
   own module does.
3. ``aten._assert_tensor_metadata`` nodes are dropped: they re-check the dtype and device an
   intermediate had when traced, which the input checks already guarantee.
4. ``fxrt.compile_graph`` compiles the graph with the caller's options (passes, own ops, arena,
   dump, cache: every option of the backend; ``freeze`` is refused, see below).

**Weights are graph inputs.** ``torch.export`` lifts parameters, buffers and tensor constants to
placeholders in front of the user's inputs; the package keeps them there and the loaded model
binds them from its state on each call (a tuple read once per call). Folding them into the graph
as constants would save nothing per call (binding a tensor is a register write) and would cost
what matters here: ``update_weights`` would need a new program, tied weights would be two
constants, and the loader could not hand the compiled graph the memory-mapped tensors as they
are. ``options={"freeze": True}`` (fold the weights into the graph) therefore raises.

The package's file layout and manifest are described in :mod:`fxrt.deploy.package`.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import torch
from torch.export.graph_signature import ConstantArgument

from ..compiler import CompiledGraph, compile_graph
from ..config import CompilerConfig
from ..exec.program import OutCall
from ..ir.graph import Op, Ref, ValueKind
from ..serialize import SerializationError, encode_graph, versions
from ..stage import lower_program
from . import package
from .program_data import cpp_runnable, encode_program
from .signature import SYMBOL, InputSig, OutputSig, Signature, leaf_paths, spec_to_json
from .tensorfile import BY_TORCH_NAME

# Options that say how the loaded model runs (stored, and accepted by fxrt.load); the others
# shaped the compiled graph and are recorded for ``inspect`` only.
RUNTIME_OPTIONS = ("pure_python", "arena", "arena_max_idle", "check_inputs")
_KINDS = {"PARAMETER": "parameter", "BUFFER": "buffer", "CONSTANT_TENSOR": "constant"}


class Package:
    """An exported, compiled model: write it with :meth:`save`, run it with ``fxrt.load``.

    Attributes:
        compiled: the :class:`fxrt.CompiledGraph` fxrt compiled; its inputs are the weights (in
            ``signature.inputs`` order) followed by the flattened call arguments.
        exported: the ``torch.export.ExportedProgram`` it was compiled from (decomposed).
        manifest: the package's JSON manifest (see :mod:`fxrt.deploy.package`).
        weights: the weights by name (the model's own tensors; :meth:`save` writes their values
            at that time).
    """

    def __init__(
        self,
        manifest: dict[str, Any],
        compiled: CompiledGraph,
        exported: Any,
        weights: dict[str, torch.Tensor],
        entries: list[tuple[str, str, tuple[int, ...], Callable[[], Any]]],
    ):
        self.manifest = manifest
        self.compiled = compiled
        self.exported = exported
        self.weights = weights
        self._entries = entries

    def write(self, f: IO[bytes]) -> int:
        """Write the package to the seekable binary file ``f``; return its length."""
        text = json.dumps(self.manifest, separators=(",", ":"), allow_nan=False).encode()
        return package.write(f, text, self._entries, {"format": package.FORMAT})

    def save(self, path: Any) -> None:
        """Write the package to ``path`` (one file, written atomically)."""
        package.save(path, self.write)

    def to_bytes(self) -> bytes:
        import io

        f = io.BytesIO()
        self.write(f)
        return f.getvalue()

    def __repr__(self) -> str:
        sig = self.manifest["signature"]
        users = [i for i in sig["inputs"] if i["kind"] != "weight"]
        return (
            f"Package({self.manifest['module']}, {len(users)} inputs, "
            f"{len(self.manifest['weights'])} weights, {len(self.compiled.graph.nodes)} nodes)"
        )


def export(
    model: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    options: Mapping[str, Any] | None = None,
    strict: bool = False,
) -> Package:
    """Trace ``model`` with ``torch.export``, decompose it to ATen and compile it with fxrt.

    Args:
        model: the module (put it in eval mode first, as for any export).
        args: example positional arguments.
        kwargs: example keyword arguments.
        dynamic_shapes: as ``torch.export.export`` takes them (``torch.export.Dim``): one package
            then serves every size in the range.
        options: fxrt compiler options (the keys of :class:`fxrt.CompilerConfig`, as for
            ``torch.compile(backend="fxrt", options=...)``). ``pure_python``, ``arena``,
            ``arena_max_idle`` and ``check_inputs`` are stored as the package's defaults for
            ``fxrt.load``.
        strict: passed to ``torch.export.export`` (non-strict by default).

    Returns:
        A :class:`Package`; ``pkg.save(path)`` writes it.

    Raises:
        ValueError: an unknown option, ``freeze`` (weights stay inputs), or something the package
            format cannot hold (a weight of an unsupported dtype, a custom object input, an input
            structure type without a serialized pytree name).
    """
    options = dict(options or {})
    config = CompilerConfig.from_options(None, options)
    if config.freeze:
        raise ValueError(
            "fxrt.export: freeze is not supported: a package keeps its weights as graph inputs "
            "(bound on each call, replaced by update_weights without recompiling)"
        )
    t0 = time.perf_counter()
    ep = torch.export.export(
        model, tuple(args), dict(kwargs or {}), dynamic_shapes=dynamic_shapes, strict=strict
    )
    t1 = time.perf_counter()
    ep = ep.run_decompositions(_decompositions())
    t2 = time.perf_counter()
    gm = ep.graph_module
    for node in list(gm.graph.nodes):
        if (
            node.op == "call_function"
            and node.target is torch.ops.aten._assert_tensor_metadata.default
        ):
            gm.graph.erase_node(node)
    gm.recompile()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    cg = compile_graph(gm, [n.meta.get("val") for n in placeholders], config)
    t3 = time.perf_counter()

    weights, kinds = _weights(ep)
    sig = _signature(ep, cg, placeholders, kinds)
    records, entries = _plan_weights(weights, kinds)
    doc, tensors = encode_graph(cg.graph, cg.pass_records)
    doc = dict(doc)
    doc.pop("versions")  # the package's "producer" records them; see fxrt.deploy.package
    doc["tensors"] = {name: r.to_json() for name, r in tensors.items()}
    for name, r in tensors.items():
        entries.append((f"graph/{name}", "U8", (r.nbytes,), lambda r=r: r.payload or b""))
    ops = {n.op.name: str(n.op.target._schema) for n in cg.graph.nodes if n.op.kind.value == "aten"}
    runtime = {k: options[k] for k in RUNTIME_OPTIONS if k in options}
    program, cpp = _stored_program(cg, runtime)
    for ins in cg.program.code:  # the out= forms the arena uses are called too
        if isinstance(ins, OutCall):
            ops[Op.of(ins.out_target).name] = str(ins.out_target._schema)
    # The export device: the weights' (or, with none, the inputs'); fxrt.load(device=...)
    # moves what is on it. Other devices a graph uses (a CPU index tensor) stay as they are.
    devices = [str(t.device) for t in weights.values()] or [
        s.device for s in sig.inputs if s.kind == "tensor"
    ]
    device = max(set(devices), key=devices.count) if devices else "cpu"
    manifest = {
        "format": package.FORMAT,
        "producer": {**versions(), "python": platform.python_version()},
        "module": type(model).__name__,
        "device": device,
        "options": _json_options(options),
        "runtime_options": runtime,
        "graph": doc,
        "program": program,
        "ops": dict(sorted(ops.items())),
        "signature": sig.to_json(),
        "weights": records,
        "info": {
            "fallbacks": list(cg.program.fallbacks),
            "demotions": [
                f"{d.node}: {d.was} -> {d.now} ({d.reason})" for d in cg.program.demotions
            ],
            "executor": cg.executor,
            "cpp": cpp,
            "seconds": {"export": t1 - t0, "decompose": t2 - t1, "compile": t3 - t2},
        },
    }
    return Package(manifest, cg, ep, weights, entries)


def _stored_program(cg: CompiledGraph, runtime: dict[str, Any]) -> tuple[Any, str | None]:
    """The program ``fxrt.load`` will lower from the package with its runtime options, as data
    (:mod:`fxrt.deploy.program_data`), and why the C++ runtime cannot run it (None if it can)."""
    config = CompilerConfig.from_options(None, {**runtime, "cache": False})
    try:
        program = encode_program(lower_program(cg.graph, cg.plan, config))
    except SerializationError as e:
        return None, f"the program cannot be stored: {e}"
    return program, cpp_runnable(program)


def _decompositions() -> dict[Any, Any]:
    """The CompositeImplicitAutograd decompositions (what make_fx applies), not core ATen's."""
    try:
        from torch._export.utils import _collect_all_valid_cia_ops, _get_decomp_for_cia
        from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS
    except ImportError:  # another torch: fall back to the core ATen table
        return torch.export.default_decompositions()
    return {
        op: _get_decomp_for_cia(op)
        for op in _collect_all_valid_cia_ops()
        if op not in PRESERVED_ATEN_CIA_OPS
    }


def _weights(ep: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The lifted inputs' tensors by name (the module's state_dict names) and their kinds."""
    weights: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for spec in ep.graph_signature.input_specs:
        kind = spec.kind.name
        if kind == "USER_INPUT":
            continue
        if kind not in _KINDS:
            raise ValueError(f"fxrt.export: graph inputs of kind {kind} are not supported")
        value = ep.state_dict.get(spec.target)
        if value is None:
            value = ep.constants.get(spec.target)
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"fxrt.export: {spec.target} is a {type(value).__name__}, not a tensor"
            )
        weights[spec.target] = value.detach()
        kinds[spec.target] = _KINDS[kind]
        if kind == "BUFFER" and spec.persistent is False:
            kinds[spec.target] = "nonpersistent_buffer"
    return weights, kinds


def _signature(
    ep: Any, cg: CompiledGraph, placeholders: list[Any], kinds: dict[str, str]
) -> Signature:
    graph = cg.graph
    in_spec, out_spec = ep.call_spec.in_spec, ep.call_spec.out_spec
    paths = iter(leaf_paths(in_spec, ("args", "kwargs")))
    inputs = []
    for spec, vid in zip(ep.graph_signature.input_specs, graph.inputs):
        value = graph.values[vid]
        name = spec.arg.name
        if spec.kind.name != "USER_INPUT":
            inputs.append(InputSig(name, "weight", weight=spec.target))
            continue
        path = next(paths)
        arg = spec.arg
        if isinstance(arg, ConstantArgument):
            v = arg.value
            if v is not None and not isinstance(v, (bool, int, float, str)):
                raise ValueError(f"fxrt.export: input {path} is a constant {type(v).__name__}")
            inputs.append(InputSig(name, "constant", path, value=v))
        elif value.kind is ValueKind.TENSOR and value.meta is not None:
            m = value.meta
            dtype = str(m.dtype).removeprefix("torch.")
            inputs.append(
                InputSig(name, "tensor", path, dtype=dtype, shape=m.shape, device=m.device)
            )
        elif value.kind is ValueKind.SYM and value.expr is not None:
            inputs.append(InputSig(name, "symint", path, shape=(value.expr,)))
        else:
            raise ValueError(f"fxrt.export: input {path} ({name}) is not a tensor or a constant")
    if len(inputs) != len(placeholders):
        raise AssertionError("fxrt.export: graph inputs do not match the exported signature")
    outputs = []
    out_refs = graph.output if isinstance(graph.output, (tuple, list)) else (graph.output,)
    user_paths = iter(leaf_paths(out_spec))
    for spec, out in zip(ep.graph_signature.output_specs, out_refs):
        kind = spec.kind.name
        if kind == "USER_OUTPUT":
            meta = graph.values[out.id].meta if isinstance(out, Ref) else None
            dtype = str(meta.dtype).removeprefix("torch.") if meta is not None else ""
            outputs.append(
                OutputSig("user", next(user_paths), dtype=dtype, shape=meta.shape if meta else ())
            )
        elif kind == "BUFFER_MUTATION":
            outputs.append(OutputSig("buffer_mutation", target=spec.target))
        elif kind == "USER_INPUT_MUTATION":
            outputs.append(OutputSig("input_mutation", target=spec.target))
        else:
            raise ValueError(f"fxrt.export: graph outputs of kind {kind} are not supported")
    ranges = {}
    for sym, vr in ep.range_constraints.items():
        if not SYMBOL.fullmatch(str(sym)):
            # A derived size (``s0 + 1`` of ``Dim`` arithmetic): its range follows from its
            # symbols', and each call checks it against them (binder.Binder.derived).
            continue
        # Unbounded ends are torch's int_oo, which sympy calls finite: test for an integer.
        lo, hi = vr.lower, vr.upper
        ranges[str(sym)] = (int(lo) if lo.is_Integer else 0, int(hi) if hi.is_Integer else None)
    return Signature(
        inputs,
        outputs,
        ranges,
        spec_to_json(in_spec, "input"),
        spec_to_json(out_spec, "output"),
        _dim_names(placeholders, ranges),
    )


def _dim_names(placeholders: list[Any], ranges: dict[str, Any]) -> dict[str, str]:
    """Size symbol -> the name of the ``torch.export.Dim`` it came from, from the shape
    environment the export traced with (empty where torch keeps no such record)."""
    env = next(
        (
            s.node.shape_env
            for n in placeholders
            if isinstance(n.meta.get("val"), torch.Tensor)
            for s in n.meta["val"].shape
            if isinstance(s, torch.SymInt)
        ),
        None,
    )
    debug = getattr(env, "source_name_to_debug_name", None) or {}
    names = {}
    for sym, sources in (getattr(env, "var_to_sources", None) or {}).items():
        for src in sources:
            name = debug.get(src.name) if isinstance(src.name, str) else debug.get(src.name())
            if isinstance(name, str) and str(sym) in ranges:
                names[str(sym)] = name
                break
    return names


def _plan_weights(
    weights: dict[str, torch.Tensor], kinds: dict[str, str]
) -> tuple[dict[str, Any], list[tuple[str, str, tuple[int, ...], Callable[[], Any]]]]:
    """One safetensors entry per storage (tensors of one dtype sharing memory), and per weight
    the view of its entry that it is.

    A storage used by one tensor, or by tied names with the same geometry, whose tensor covers it
    contiguously is stored under the first name with the tensor's shape (the section reads as an
    ordinary state dict). Otherwise the entry is the 1-D range of elements its tensors use, and
    each weight is a strided view of it."""
    groups: dict[Any, list[str]] = {}
    for name, t in weights.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in BY_TORCH_NAME or t.layout != torch.strided or t.is_quantized:
            raise ValueError(
                f"fxrt.export: weight {name!r} ({t.dtype}, {t.layout}) cannot be stored"
            )
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            raise ValueError(f"fxrt.export: weight {name!r} is a {type(t).__name__}")
        ptr = t.untyped_storage().data_ptr()
        key = (ptr, t.device, t.dtype) if ptr and t.numel() else ("empty", name)
        groups.setdefault(key, []).append(name)
    records: dict[str, Any] = {}
    entries: list[tuple[str, str, tuple[int, ...], Callable[[], Any]]] = []
    for names in groups.values():
        ts = [weights[n] for n in names]
        t0 = ts[0]
        code = BY_TORCH_NAME[str(t0.dtype).removeprefix("torch.")]
        geometry = {(tuple(t.shape), tuple(t.stride()), t.storage_offset()) for t in ts}
        whole = (
            len(geometry) == 1
            and t0.is_contiguous()
            and t0.storage_offset() == 0
            and t0.numel() * t0.element_size() == t0.untyped_storage().nbytes()
        )
        if whole or t0.numel() == 0:
            shape, lo = tuple(t0.shape), t0.storage_offset()
            data = t0
        else:
            lo = min(t.storage_offset() for t in ts if t.numel())
            hi = max(t.storage_offset() + _extent(t) for t in ts if t.numel())
            shape = (hi - lo,)
            data = torch.empty(0, dtype=t0.dtype, device=t0.device).set_(
                t0.untyped_storage(), lo, shape, (1,)
            )
        entries.append((names[0], code, shape, lambda d=data: _bytes(d)))
        for n, t in zip(names, ts):
            records[n] = {
                "entry": names[0],
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "offset": t.storage_offset() - lo if not (whole or t0.numel() == 0) else 0,
                "kind": kinds[n],
            }
    return records, entries


def _extent(t: torch.Tensor) -> int:
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _bytes(t: torch.Tensor) -> Any:
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def _json_options(options: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in sorted(options.items()):
        if v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
            out[k] = list(v)
        else:
            out[k] = f"<{type(v).__name__}>"  # a user pass: applied at export, not stored
    return out


__all__ = ["RUNTIME_OPTIONS", "Package", "export"]
