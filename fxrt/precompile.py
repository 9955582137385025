"""PyTorch's own precompile with ``backend="fxrt"``.

Two PyTorch APIs save Dynamo's work with the backend's result and load it in a fresh process:

* ``torch.compile(fn, fullgraph=True, backend="fxrt").aot_compile(((args), {kwargs}))``, then
  ``save_compiled_function(path)`` and ``torch.compiler.load_compiled_function(file)``: Dynamo
  asks the backend's result for its bytes through ``SerializableCallable``'s two class methods.
  :class:`fxrt.CompiledGraph` implements them (it is registered as a virtual subclass, so a call
  still goes straight to the executor).
* ``TORCH_CACHING_PRECOMPILE=1`` (Dynamo's caching precompile): the backend records an
  ``fxrt.backend.FxrtArtifact`` for each graph it compiles, keyed by the graph's ``_backend_id``;
  ``torch.compiler.save_cache_artifacts()`` writes them with Dynamo's guards, and a later process
  loads them when it calls ``torch.compile`` and never calls the backend.

Both carry fxrt's data-only artifact (:mod:`fxrt.serialize`: ops by qualified name, tensors as
bytes, validated on load exactly as a cache entry) plus the options the graph runs under (those a
loaded graph needs: the mode, capture, input checks, the arena; process-local ones such as the
cache or dump directory are the loading process's). PyTorch lifts a model's parameters and
buffers to graph inputs, so the bytes hold no weights: the loaded function takes the module
(``loaded(model, x)``) and reads its current weights.

Only inference graphs precompile: a graph compiled for autograd (an input requires grad and
grad mode is on) is AOTAutograd's forward and backward pair, which this format does not hold;
the error says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .artifact import ArtifactError, decode_tensor, pack, unpack
from .config import CompilerConfig
from .serialize import SerializationError, decode_graph, encode_graph

KIND = "fxrt-precompiled/1"
# Where the loading process's own settings apply, not the compiling one's.
_PROCESS_LOCAL = frozenset({"dump_dir", "cache", "cache_dir", "cache_max_bytes"})
# Never carried: objects (a graph pool), and the deprecated spelling of own_ops.
_NEVER = _PROCESS_LOCAL | {"use_graph_pool", "native_kernels"}
_PLAIN = (bool, int, float, str, type(None))


def _carried_options(config: CompilerConfig) -> dict[str, Any]:
    """The options that differ from this process's defaults and are plain data."""
    default = CompilerConfig()
    out = {}
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if f.name in _NEVER or v == getattr(default, f.name):
            continue
        if isinstance(v, _PLAIN) or (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            out[f.name] = v
    return out


def serialize(cg: Any) -> bytes:
    """The bytes of a compiled graph for PyTorch's precompile.

    Raises:
        SerializationError: the graph holds something the format cannot name (a higher-order
            op, a Python callable other than pure arithmetic).
    """
    try:
        doc, tensors = encode_graph(cg.graph, cg.pass_records, check_exprs=True)
    except SerializationError as e:
        raise SerializationError(f"fxrt cannot save {cg.name} for precompile: {e}") from None
    doc["precompiled"] = {"kind": KIND, "options": _carried_options(cg.config)}
    return pack(doc, tensors)


def deserialize(data: bytes, rebuild: Callable[..., Any]) -> Any:
    """``rebuild(graph, plan, pass_records, config)`` of :func:`serialize` bytes, loading data
    only (``CompiledGraph.deserialize_compile_artifacts`` passes its constructor).

    Raises:
        SerializationError: not fxrt's precompile bytes, damaged, invalid, or made by another
            fxrt or torch.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SerializationError(f"fxrt precompile data must be bytes, got {type(data).__name__}")
    try:
        doc, section = unpack(bytes(data))
    except ArtifactError as e:
        raise SerializationError(f"not valid fxrt precompile data: {e}") from None
    head = doc.pop("precompiled", None) if isinstance(doc, dict) else None
    if not isinstance(head, dict) or head.get("kind") != KIND:
        raise SerializationError(f"not {KIND} data (an fxrt artifact of another kind?)")
    options = head.get("options")
    if not isinstance(options, dict) or set(options) & _NEVER:
        raise SerializationError(f"invalid options in fxrt precompile data: {options!r:.200}")
    try:
        config = dataclasses.replace(CompilerConfig(), **options)
    except (TypeError, ValueError) as e:
        raise SerializationError(f"invalid options in fxrt precompile data: {e}") from None
    graph, plan, records, _ = decode_graph(doc, lambda _n, r: decode_tensor(r, section.read(r)))
    return rebuild(graph, plan, records, config)
