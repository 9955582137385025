"""The compile cache around a compile: look the key up, load a hit, store a miss.

:func:`cached_compile` is what the backend and :func:`fxrt.compile_graph` call with the graph
they key on and a ``build()`` that compiles it; keys are :mod:`fxrt.cache.keys`', entries live in
:mod:`fxrt.cache.store` in the format of :mod:`fxrt.serialize`. A hit behaves exactly like a miss:
the caller's own constants are its live tensors, source lines are this process's, dumps are
written; whatever is wrong with an entry (or with storing one) warns and compiles, never fails.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils._python_dispatch import _disable_current_modes

from ..artifact import ArtifactError, TensorRecord, content_hash, decode_tensor, pack, unpack
from ..config import CompilerConfig
from ..dump import Dumper
from ..ir import Graph
from ..modes import gc_paused, outside_inference_mode
from ..serialize import SerializationError, decode_graph, encode_graph
from ..shapefacts import ShapeFacts
from . import stats
from .keys import LEVELS, Unkeyable, cache_key, graph_name, open_store
from .store import Store

log = logging.getLogger("fxrt")

# (graph, plan, pass records, config) -> a runnable compiled graph.
Rebuild = Callable[[Graph, Any, list[Any], CompilerConfig], Any]


def cached_compile(
    key_graph: Graph,
    example_inputs: Sequence[Any] | None,
    config: CompilerConfig,
    build: Callable[[], Any],
    gm: torch.fx.GraphModule | None = None,
    *,
    rebuild: Rebuild,
    level: str = "aten",
    shapes: ShapeFacts | None = None,
) -> Any:
    """``build()``, or the on-disk cache's entry for ``key_graph`` when there is one, made
    runnable by ``rebuild(graph, plan, pass_records, config)`` (``CompiledGraph._rebuilt``).

    ``level`` says what ``key_graph`` is (:data:`fxrt.LEVELS`). ``shapes``: the shape
    environment of a graph with symbolic sizes; the key includes its facts, the entry the guards
    ``build()`` added, and a hit adds them again (:mod:`fxrt.shapefacts`).

    The key, the load and the store run outside any fake or dispatch mode (Dynamo calls backends
    under its fake mode): constants are hashed and loaded as the real tensors they are. On a hit,
    the graph's constants that were the caller's own (parameters, buffers) are the caller's
    tensors of this process, and source lines in errors are this process's.
    """
    if not config.cache:
        return build()
    name = graph_name(key_graph)
    with _disable_current_modes():
        try:
            facts = shapes.key() if shapes is not None else None
            key = cache_key(key_graph, example_inputs or (), config, level=level, shape_facts=facts)
        except Unkeyable as e:
            stats["uncached"] += 1
            log.info("fxrt cache: not caching %s: %s", name, e)
            key = None
        store = open_store(config) if key is not None else None
        if store is not None:
            t0 = time.perf_counter()
            with gc_paused(), outside_inference_mode():
                hit = _load_entry(store, key, key_graph, config, shapes, rebuild)
            seconds = time.perf_counter() - t0
    if store is None:  # build() runs in the caller's modes (Dynamo's fake mode)
        return build()
    if hit is not None:
        hit.cache_key = key
        stats["hit"] += 1
        log.info(
            "fxrt cache: hit %s %s, key %s, loaded in %.1f ms",
            name, LEVELS[level], key[:16], seconds * 1e3,
        )  # fmt: skip
        if config.dump_dir:
            _dump_hit(config.dump_dir, gm, hit, store.entry_path(key))
        return hit
    stats["miss"] += 1
    log.info("fxrt cache: miss %s %s, key %s", name, LEVELS[level], key[:16])
    # What the entry refers to, taken before build(), whose passes may edit ``key_graph``.
    caller = list(key_graph.constants.values())
    traces = [n.stack_trace for n in key_graph.nodes]
    guards: list[str] = []
    if shapes is None:
        cg = build()
    else:
        try:
            with shapes.recording(guards):
                cg = build()
        except Unkeyable as e:  # raised once build() returned: compiled, not stored
            log.debug("fxrt cache: not storing %s: %s", name, e)
            stats["uncached"] += 1
            return cg
    with _disable_current_modes():
        _store_entry(store, key, caller, traces, cg, name, level, guards)
    cg.cache_key = key
    return cg


def _load_entry(
    store: Store,
    key: str,
    key_graph: Graph,
    config: CompilerConfig,
    shapes: ShapeFacts | None,
    rebuild: Rebuild,
) -> Any:
    found = store.read(key)
    if found is None:
        return None
    data, record = found
    path = store.entry_path(key)
    try:
        if record.get("sha256") != content_hash(data):
            raise SerializationError("content does not match the index's SHA-256")
        try:
            doc, _ = unpack(data)
        except ArtifactError as e:
            raise SerializationError(str(e)) from None

        def fetch(_name: str, r: TensorRecord) -> torch.Tensor:
            try:
                return decode_tensor(r, store.read_blob(r.sha256))
            except OSError as e:
                raise SerializationError(f"tensor bytes missing: {e}") from None

        guards = doc.pop("shape_guards", []) if isinstance(doc, dict) else []
        if shapes is None and guards != []:
            raise SerializationError("shape guards in an entry of a graph without symbolic sizes")
        if shapes is not None and not shapes.admits(guards):
            # Valid, but for other sizes: this trace would take other branches. A miss.
            log.debug("fxrt cache: entry %s is for other sizes (a shape guard is false)", key[:16])
            return None
        caller = list(key_graph.constants.values())
        graph, plan, records, traces = decode_graph(doc, fetch, caller)
        for node, i in zip(graph.nodes, traces):
            if i is not None and i < len(key_graph.nodes):
                node.stack_trace = key_graph.nodes[i].stack_trace  # this process's source line
        cg = rebuild(graph, plan, records, config)
        if shapes is not None:
            shapes.replay(guards)  # as the trace would have: Dynamo's guards include them
    except Exception as e:  # whatever is wrong with an entry, a cache never fails a compile
        stats["rejected"] += 1
        warnings.warn(
            f"fxrt cache: ignoring unusable entry {path} ({type(e).__name__}: {e}); removed it "
            "and compiling again",
            stacklevel=4,
        )
        with contextlib.suppress(OSError):
            store.remove(key)
        return None
    with contextlib.suppress(OSError):  # a read-only cache still serves hits
        store.touch(key)
    return cg


def _store_entry(
    store: Store,
    key: str,
    caller: list[Any],
    caller_traces: list[str | None],
    cg: Any,
    name: str,
    level: str,
    guards: list[str],
) -> None:
    first_with: dict[str, int] = {}
    for i, trace in enumerate(caller_traces):
        if trace:
            first_with.setdefault(trace, i)
    traces = [first_with.get(n.stack_trace) if n.stack_trace else None for n in cg.graph.nodes]
    try:
        doc, tensors = encode_graph(cg.graph, cg.pass_records, caller, traces, check_exprs=True)
        if guards:
            doc["shape_guards"] = guards
        data = pack(doc, tensors, inline=False)
    except SerializationError as e:
        stats["uncached"] += 1  # e.g. a higher-order op: compiled, just not stored
        log.debug("fxrt cache: not storing %s: %s", name, e)
        return
    except Exception as e:  # a store never fails a compile: the graph works, only uncached
        stats["uncached"] += 1
        warnings.warn(
            f"fxrt cache: {name} compiled but not stored ({type(e).__name__}: {e}); it will be "
            "compiled again next time. Please report this.",
            stacklevel=4,
        )
        return
    record = {
        "name": name,
        "level": level,
        "ops": len(cg.graph.nodes),
        "versions": doc["versions"],
        "sha256": content_hash(data),
    }
    try:
        store.write(key, data, {r.sha256: r.payload or b"" for r in tensors.values()}, record)
    except OSError as e:
        warnings.warn(f"fxrt cache: cannot store {name} in {store.root} ({e})", stacklevel=4)
        return
    stats["stored"] += 1
    log.info("fxrt cache: stored %s key %s (%d bytes)", name, key[:16], len(data))


def _dump_hit(root: str, gm: torch.fx.GraphModule | None, cg: Any, entry: Any) -> None:
    dump = Dumper(root)
    if gm is not None:
        dump.fx("input_fx.txt", gm)
    dump.write(
        "cache_hit.txt",
        f"loaded from the compile cache entry {entry}; the files of each pass were written "
        "by the process that compiled it",
    )
    dump.final(cg.graph, cg.program)


__all__ = ["Rebuild", "cached_compile"]
