"""fxrt's Python loader: a package file to a :class:`PythonLoadedModel`, its graph decoded and
lowered again here. :func:`fxrt.load` runs packages on the C++ runtime (:mod:`.runtime_model`) and
uses this loader for the Python loop and for packages the runtime does not run.

The manifest (JSON, ``"format": "fxrt-package/1"``) holds::

    producer         fxrt / torch / python versions and fxrt's source hash (informational)
    module           the exported module's class name
    device           the device the model was exported on
    options          the compiler options given to fxrt.export (informational)
    runtime_options  the defaults for fxrt.load: pure_python, arena, arena_max_idle, check_inputs
    graph            the compiled fxrt IR, in fxrt.serialize's artifact encoding; its tensors
                     (constants fxrt made) are the weights section's "graph/<name>" entries
    program          the lowered Program as data, for the C++ runtime
                     (fxrt.deploy.program_data; null when it cannot be encoded; absent in
                     packages of fxrt versions before it)
    ops              every ATen op the graph calls: qualified name -> schema string
    signature        graph inputs (weight / tensor / constant / symint), outputs (user leaf /
                     buffer or input mutation), size-symbol ranges and Dim names, in and out
                     tree specs (fxrt.deploy.signature)
    weights          name -> {entry, dtype, shape, stride, offset, kind}: a strided view of a
                     weights-section entry (tied names share an entry)
    info             fallbacks, demotions and timings of the export (informational)

Loading (after :func:`fxrt.deploy.package.read` has checked the structure and hashes):

1. Every manifest field is type-checked; every name it refers to (weight entries, graph tensors,
   signature weights) must exist; every entry must be used.
2. Every op of ``ops`` is looked up through ``torch.ops`` by its validated name and its schema
   compared with the stored one: a package made by another torch loads when they all match, and
   fails naming the first op whose schema changed.
3. The graph is decoded by :func:`fxrt.serialize.decode_graph`, which validates it as it does
   cache artifacts (ops only by name, Python fallbacks only from the pure-arithmetic allow-list,
   every id bounds-checked, the graph verified) and recomputes the lifetime plan; the program and
   arena are lowered again here. Only the versions check differs: a cache entry must come from
   this exact fxrt and torch, a package from any that agree on the ops. The stored program must
   equal the one lowered here with the package's runtime options (on the export device; loading
   onto another device lowers for it and runs that), or the package is refused.
4. Weights are tensors on the memory-mapped file's pages (copy-on-write: a write changes this
   process's page, never the file), moved to ``device`` if one is given, and must match the
   graph's metadata for their inputs. With ``device``, the graph's device arguments and metadata
   are retargeted from the export device to it.
5. The tree specs are rebuilt from pytree's registry of this process only.

What a loaded model keeps: the compiled graph (its IR, plan, program and executor), the
signature, the weights, and the manifest's text (``LoadedModel.manifest`` parses it on first
use). The parsed manifest is dropped part by part as the load uses it, since its peak stays
resident in the allocator's pools; the file's pages before the weights are unmapped once parsed.

Calls are thread-safe: the compiled graph takes a frame per call, and the weights are one tuple
read once per call, which :meth:`LoadedModel.update_weights` replaces in one assignment. With the
compiled loop, a call made as the package was exported goes from the LoadedModel to the loop with
no Python frame (the extension's ``PackageEntry``, the base class, checks it in C++); any other
call is :meth:`LoadedModel._call`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..compiler import CompiledGraph
from ..config import CompilerConfig
from ..exec.inputs import InputError
from ..exec.native import NativeLoop, NativePackageEntry
from ..ir.graph import OpKind
from ..modes import gc_paused
from ..serialize import FORMAT as GRAPH_FORMAT
from ..serialize import SerializationError, decode_graph, resolve_op
from ..stage import lower_program
from . import package
from .binder import Binder
from .package import PackageError
from .program_data import encode_program, first_difference
from .signature import Signature, spec_from_json
from .tensorfile import loads_json
from .weights import updated_weights, weight_records, weight_tensors

_MANIFEST_KEYS = {
    "format",
    "producer",
    "module",
    "device",
    "options",
    "runtime_options",
    "graph",
    "ops",
    "signature",
    "weights",
    "info",
}
_OPTIONAL_KEYS = {"program"}
RUNTIME_OPTIONS = ("pure_python", "arena", "arena_max_idle", "check_inputs")


def _fail(msg: str) -> PackageError:
    return PackageError(f"invalid fxrt package: {msg}")


def load_python(
    path: str | os.PathLike[str] | bytes | bytearray | memoryview,
    device: str | torch.device | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    verify_weights: bool = True,
) -> PythonLoadedModel:
    """:func:`load` on the Python loader: the package's graph decoded and lowered again here, run
    on the loop its options choose (the Python loop with ``pure_python``). fxrt.load uses it
    where the C++ runtime does not run the package; the runtime's face uses it for the IR a user
    inspects and for calls under a profiler or ``__torch_function__``."""
    if isinstance(path, (bytes, bytearray, memoryview)):
        raw = package.read(bytearray(path), verify_weights=verify_weights)
        where = "<bytes>"
    else:
        raw = package.read_path(path, verify_weights=verify_weights)
        where = os.fspath(path)
    with gc_paused():
        try:
            return _build(raw, where, device, dict(options or {}))
        except PackageError:
            raise
        except SerializationError as e:
            raise PackageError(f"invalid fxrt package: {str(e)[:400]}") from None
        except Exception as e:  # whatever else a hostile manifest provokes: one clean error
            raise _fail(f"{type(e).__name__}: {str(e)[:300]}") from e


def _build(
    raw: package.RawPackage, where: str, device: Any, options: dict[str, Any]
) -> PythonLoadedModel:
    m = raw.manifest
    if not _MANIFEST_KEYS <= set(m) <= _MANIFEST_KEYS | _OPTIONAL_KEYS:
        raise _fail(f"manifest fields {sorted(map(str, m))[:20]}")
    for key in ("producer", "options", "runtime_options", "graph", "ops", "weights", "info"):
        if not isinstance(m[key], dict):
            raise _fail(f"{key} must be an object")
    export_device = _device(m["device"], "device")
    # "cuda" means the current CUDA device, as a tensor made there records it ("cuda:0"): the
    # weights, the graph and the input check must all name that one device.
    target = export_device if device is None else torch.empty(0, device=device).device

    from ..exec.native import extension_status

    extension_status()  # loading the extension registers fxrt's own ops, which graphs may call
    _check_ops(m["ops"], m["producer"])

    sig = Signature.from_json(m["signature"])
    records = weight_records(m["weights"], raw.entries)
    graph_doc = m["graph"]
    if graph_doc.get("format") != GRAPH_FORMAT:
        raise PackageError(
            f"the package's graph is in format {str(graph_doc.get('format'))[:40]!r}; this fxrt "
            f"reads {GRAPH_FORMAT}"
        )
    if target != export_device:
        graph_doc = _retarget(graph_doc, export_device, target)
    used = {r["entry"] for r in records.values()}
    graph_tensors = graph_doc.get("tensors", {})
    if not isinstance(graph_tensors, dict):
        raise _fail("graph tensors must be an object")
    used |= {f"graph/{k}" for k in graph_tensors}
    unused = sorted(set(raw.entries) - used)
    if unused:
        raise _fail(f"weights section entries used by nothing: {unused[:5]}")

    def fetch(name: str, record: Any) -> torch.Tensor:
        from ..artifact import decode_tensor

        e = raw.entries.get(f"graph/{name}")
        if e is None or e.dtype != "U8":
            raise _fail(f"graph tensor {name[:60]!r} has no U8 entry")
        start = raw.data_start + e.begin
        return decode_tensor(record, bytes(raw.buf[start : start + (e.end - e.begin)]))

    # The versions check of cache artifacts does not apply: ops were checked by schema above.
    graph, plan, pass_records, _ = decode_graph(graph_doc, fetch, check_versions=False)
    for node in graph.nodes:
        if node.op.kind is OpKind.ATEN and node.op.name not in m["ops"]:
            raise _fail(f"node {node.name} calls {node.op.name}, which the ops table lacks")
    # The graph's document is most of the parsed manifest: drop it now, so that lowering reuses
    # its memory instead of adding to the peak (the allocator keeps a process's peak resident).
    # LoadedModel.manifest parses the manifest's text again when asked for.
    del graph_doc, graph_tensors, m["graph"]

    tensors = weight_tensors(raw, records, target)
    if len(sig.inputs) != len(graph.inputs):
        raise _fail(f"{len(sig.inputs)} signature inputs for {len(graph.inputs)} graph inputs")
    for s, vid in zip(sig.inputs, graph.inputs):
        value = graph.values[vid]
        if s.kind == "weight":
            t = tensors.get(s.weight)
            if t is None:
                raise _fail(f"input {s.name[:60]!r} names an unknown weight {s.weight[:60]!r}")
            m_ = value.meta
            if m_ is None or (tuple(t.shape), tuple(t.stride()), t.dtype) != (
                m_.shape,
                m_.stride,
                m_.dtype,
            ):
                raise _fail(f"weight {s.weight[:60]!r} does not match graph input {value.name}")
        elif s.kind == "tensor":
            m_ = value.meta
            if m_ is None or (m_.shape, str(m_.dtype).removeprefix("torch.")) != (s.shape, s.dtype):
                raise _fail(f"input {s.name[:60]!r} does not match graph input {value.name}")
    in_spec = spec_from_json(sig.in_spec, "input")
    out_spec = spec_from_json(sig.out_spec, "output")
    n_users = sum(1 for o in sig.outputs if o.kind == "user")
    if in_spec.num_leaves != len(sig.user_inputs()) or out_spec.num_leaves != n_users:
        raise _fail("the tree specs do not match the signature")

    runtime = m["runtime_options"]
    if set(runtime) - set(RUNTIME_OPTIONS):
        raise _fail(f"unknown runtime options {sorted(runtime)[:5]}")
    try:
        config = CompilerConfig.from_options(None, {**runtime, **options, "cache": False})
    except ValueError as e:
        raise _fail(str(e)) from None
    program = lower_program(graph, plan, config)
    if m.get("program") is not None and target == export_device:
        check = program
        if any(k in options for k in ("arena", "check_inputs")):
            as_stored = CompilerConfig.from_options(None, {**runtime, "cache": False})
            check = lower_program(graph, plan, as_stored)
        _check_program(m["program"], check)
    m.pop("program", None)
    cg = CompiledGraph(graph, plan, program, config)
    cg.pass_records = pass_records
    binder = Binder(sig, in_spec, None if device is None else target)
    return PythonLoadedModel(
        cg, sig, binder, out_spec, tensors, records, m.get("module"), raw.manifest_json, where
    )


def _check_program(stored: Any, program: Any) -> None:
    """The stored program (what the C++ runtime runs) must be the one lowered from the graph."""
    try:
        ours = encode_program(program)
    except SerializationError:
        ours = None
    if ours != stored:
        where = first_difference(stored, ours)
        raise _fail(f"the stored program differs from the graph's ({str(where)[:120]})")


def _check_ops(ops: dict[str, Any], producer: dict[str, Any]) -> None:
    made_by = f"torch {str(producer.get('torch'))[:40]}"
    for name, schema in ops.items():
        if not isinstance(schema, str):
            raise _fail(f"ops: malformed schema of {name[:60]!r}")
        try:
            op = resolve_op(name)
        except SerializationError as e:
            raise PackageError(f"fxrt package: {e}") from None
        now = str(op._schema)
        if now != schema:
            raise PackageError(
                f"fxrt package: op {name} changed its schema since the package was made "
                f"({made_by}: `{schema[:300]}`; this torch {torch.__version__}: `{now}`); export "
                "the model again"
            )


def _device(x: Any, where: str) -> torch.device:
    if not isinstance(x, str) or len(x) > 40:
        raise _fail(f"{where}: malformed device")
    try:
        return torch.device(x)
    except RuntimeError:
        raise _fail(f"{where}: {x!r} is not a device") from None


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


class _PythonEntry:
    """What LoadedModel's calls go through without the compiled loop's extension."""

    _prefix: tuple = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(args, kwargs)


# With the extension, a call made as the package was exported goes to the compiled loop with no
# Python frame of fxrt's (the extension's PackageEntry; _call is the path of every other call).
_Entry: type = NativePackageEntry or _PythonEntry


class PythonLoadedModel(_Entry):
    """A package on the Python loader: call it as the exported model was called.

    Attributes:
        compiled: the :class:`fxrt.CompiledGraph` it runs.
        program: its Program (``print(m.program)``).
        graph: its fxrt IR.
        signature: the calling convention (:class:`fxrt.deploy.signature.Signature`).
        manifest: the package's manifest.
    """

    def __init__(
        self,
        cg: CompiledGraph,
        sig: Signature,
        binder: Binder,
        out_spec: pytree.TreeSpec,
        weights: dict[str, torch.Tensor],
        records: dict[str, Any],
        module: Any,
        manifest_json: bytes,
        where: str,
    ):
        self.compiled = cg
        self.program = cg.program
        self.graph = cg.graph
        self.signature = sig
        # The manifest is kept as its text (a fraction of the memory of the parsed objects, of
        # which the graph and program documents are most) and parsed again when asked for.
        self._manifest_json = manifest_json
        self._manifest: dict[str, Any] | None = None
        self._module = module
        self.path = where
        self._binder = binder
        self._out_spec = out_spec
        self._kinds = {name: r["kind"] for name, r in records.items()}
        self._lock = threading.Lock()
        # Tied names: one tensor object at load (same entry and geometry).
        self._ties: dict[str, tuple[str, ...]] = {}
        by_obj: dict[int, list[str]] = {}
        for name, t in weights.items():
            by_obj.setdefault(id(t), []).append(name)
        for names in by_obj.values():
            for n in names:
                self._ties[n] = tuple(names)
        w_inputs = [s.weight for s in sig.inputs if s.kind == "weight"]
        self._weight_names = tuple(w_inputs)
        kinds = [s.kind for s in sig.inputs]
        n_w = len(w_inputs)
        self._fast = all(k == "weight" for k in kinds[:n_w]) and all(
            k != "weight" for k in kinds[n_w:]
        )
        # The weights are static inputs: the compiled loop keeps them between calls.
        self._run = cg.entry([i for i, k in enumerate(kinds) if k == "weight"])
        leaf = iter(range(len(kinds)))
        self._gather = [
            ("w", s.weight) if s.kind == "weight" else ("u", next(leaf)) for s in sig.inputs
        ]
        user_leaves = {s.name: i for i, s in enumerate(sig.user_inputs())}
        self._user_out = [i for i, o in enumerate(sig.outputs) if o.kind == "user"]
        self._mutations = []
        for i, o in enumerate(sig.outputs):
            if o.kind == "buffer_mutation":
                if o.target not in weights:
                    raise _fail(f"output {i} mutates an unknown buffer {o.target[:60]!r}")
                self._mutations.append((i, "w", o.target))
            elif o.kind == "input_mutation":
                if o.target not in user_leaves:
                    raise _fail(f"output {i} mutates an unknown input {o.target[:60]!r}")
                self._mutations.append((i, "u", user_leaves[o.target]))
        self._plain_out = not self._mutations and out_spec.is_leaf() and len(self._user_out) == 1
        self._state = self._publish(weights)
        self._prefix = self._state[0]
        direct = self._fast and self._plain_out and isinstance(self._run, NativeLoop)
        if direct and binder.n_args >= 0 and not (binder.derived or binder.derived_ints):
            self._set_direct(self._run, binder.n_args, *binder.tables())

    def _publish(self, weights: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], dict]:
        return tuple(weights[n] for n in self._weight_names), weights

    # -- calling

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call the direct path (the extension's) does not take, or every call without it."""
        prefix, weights = self._state  # one read: a concurrent update_weights does not mix in
        binder = self._binder
        leaves = args if not kwargs and len(args) == binder.n_args else binder.flatten(args, kwargs)
        if binder.needs_quick:
            binder.quick(leaves)
        if self._fast:
            inputs = [*prefix, *leaves]
        else:
            inputs = [weights[k] if w == "w" else leaves[k] for w, k in self._gather]
        try:
            out = self._run(inputs)
        except InputError:
            binder.check(leaves)  # names the input, its path, the dim and the range
            raise
        if self._plain_out:
            return out[0]
        for i, where, k in self._mutations:
            (weights[k] if where == "w" else leaves[k]).copy_(out[i])
        return pytree.tree_unflatten([out[i] for i in self._user_out], self._out_spec)

    def _call_failed(self, args: tuple[Any, ...], exc: BaseException) -> None:
        """The direct path's call failed with ``exc``: an input the compiled graph refused is
        named as :meth:`_call` names it."""
        if isinstance(exc, InputError):
            self._binder.check(args)

    # -- weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights by name (tied names map to one tensor)."""
        return dict(self._state[1])

    def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
    ) -> None:
        """As :meth:`fxrt.deploy.LoadedModel.update_weights` (the same semantics and errors,
        fxrt.deploy.weights in Python)."""
        with self._lock:
            updated = updated_weights(self._state[1], state_dict, self._ties, self._kinds, strict)
            self._state = self._publish(updated)
            self._prefix = self._state[0]

    # -- inspection

    @property
    def manifest(self) -> dict[str, Any]:
        """The package's manifest (parsed from its text on first use; the same object after)."""
        if self._manifest is None:
            with self._lock:
                if self._manifest is None:
                    self._manifest = loads_json(self._manifest_json, "manifest")
        return self._manifest

    @property
    def executor(self) -> str:
        return self.compiled.executor

    def __repr__(self) -> str:
        users = ", ".join(s.name for s in self.signature.user_inputs())
        return (
            f"LoadedModel({self._module}({users}) from {self.path}, "
            f"{len(self.graph.nodes)} nodes, executor={self.executor!r})"
        )


__all__ = ["RUNTIME_OPTIONS", "PythonLoadedModel", "load_python"]
