"""Compile-cache keys: what a cached graph's behaviour depends on, hashed.

A key is a SHA-256 of:

* the canonical IR text of the graph fxrt was handed (every op, argument, input and output type),
  and for each Python callable in it that is not torch's or Python's own (an ``allow_in_graph``
  helper, a function in a hand-built graph) its *fingerprint*: its bytecode, constants, default
  arguments, the values it closes over and the globals it reads, recursively. That is everything
  tracing the graph to ATen depends on besides torch itself, so the key determines the ATen graph
  fxrt compiles without paying for the trace;
* the sizes, strides, dtypes, devices and ``requires_grad`` of the inputs, and the same plus the
  bytes of every constant the graph owns;
* the compiler config, user passes and kernel overrides by fingerprint, fxrt's own CPU ops, the
  artifact format, the torch and fxrt versions and a SHA-256 of the content of fxrt's sources and
  of its built extension.

Fingerprints and the source hash are :mod:`fxrt.fingerprint`'s. What cannot be fingerprinted (an
object of unknown type in a closure, a module-level object a function reads) makes the graph
uncached: it is compiled every time, and the ``fxrt`` logger says why at debug level. Keys never
use ``id()``. Keys are computed outside any fake or dispatch mode. Entries are stored by
:mod:`fxrt.cache.store`, in the format of :mod:`fxrt.serialize`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from ..artifact import MAGIC
from ..fingerprint import Unkeyable, fingerprint, is_trusted, source_hash  # noqa: F401 (re-exported)
from ..ir.graph import OpKind
from ..ir.printer import graph_to_text
from ..ops.overrides import registry_fingerprint
from ..ops.own_ops import available as own_ops_available
from ..patterns import registry_fingerprint as pattern_fingerprint
from ..serialize import FORMAT, versions
from . import stats  # noqa: F401 (re-exported)
from .store import Store, cache_dir

# What an entry's key was computed on. "dynamo": the graph Dynamo hands over, before fxrt traces
# it to ATen (a hit skips the trace); "aten": an ATen graph as handed over (AOTAutograd's
# forward/backward, ``compile_graph``'s argument).
LEVELS = {"dynamo": "before the ATen trace", "aten": "on the ATen graph handed over"}
log = logging.getLogger("fxrt")
# Where things go, or how the loaded program runs (a hit is lowered under the caller's config):
# not what is compiled.
_NOT_KEYED = (
    "dump_dir",
    "cache",
    "cache_dir",
    "cache_max_bytes",
    "pure_python",
    "check_inputs",
    "arena_max_idle",
    # Whole-graph capture happens at call time, on whatever graph the cache gives.
    "mode",
    "capture",
    "capture_warmup",
    "capture_limit",
    "clone_input",
    "clone_output",
    "use_graph_pool",
    "force_eager",
)


# ----------------------------------------------------------------------------------------------
# The key


def _describe_input(x: Any, symbolic: bool) -> str:
    """An input's metadata; with ``symbolic``, sizes may be symbols (a Dynamo fake's), written
    by name (the key's shape facts say what each symbol may be)."""
    if isinstance(x, torch.Tensor):
        return f"T{x.dtype}{tuple(x.shape)}{x.stride()}{x.device}{x.requires_grad}"
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        if not symbolic:
            raise Unkeyable("a symbolic input")
        return f"{type(x).__name__}:{x}"
    if x is None or isinstance(x, bool | int | float | complex | str | bytes):
        return f"{type(x).__name__}:{x!r}"
    if isinstance(x, torch.dtype | torch.device | torch.layout | torch.memory_format):
        return f"torch:{x}"
    return _describe_opaque(x)


def _describe_opaque(x: Any) -> str:
    """An opaque object input (``torch.library``'s registered types; Dynamo lifts hoisted ones
    to graph inputs, e.g. a serving engine's layer names): a value type by the value it
    declares (``__fx_repr__``, which its ``__eq__`` guards on), never by an address. A reference
    type, or any other object, has no value to key by."""
    from torch._library.fake_class_registry import FakeScriptObject
    from torch._library.opaque_object import get_opaque_obj_repr, is_opaque_value_type

    if isinstance(x, FakeScriptObject):  # how Dynamo may hand over an opaque input
        x = x.real_obj
    cls = type(x)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if is_opaque_value_type(cls):
        try:
            text, _ = get_opaque_obj_repr(x)
        except Exception as e:
            raise Unkeyable(
                f"an opaque input of type {name} whose value cannot be read: {e}"
            ) from None
        return f"opaque:{name}:{text}"
    raise Unkeyable(
        f"an input of type {name} (only tensors, numbers, strings and opaque value types are "
        "keyed by value)"
    )


def config_text(config: Any) -> str:
    parts = []
    for f in dataclasses.fields(config):
        if f.name in _NOT_KEYED:
            continue
        v = getattr(config, f.name)
        if callable(v):
            try:
                v = "fingerprint:" + fingerprint(v)
            except Unkeyable as e:
                raise Unkeyable(f"option {f.name}: {e}") from None
        parts.append(f"{f.name}={v!r}")
    return ";".join(parts)


def cache_key(
    graph: Any,
    example_inputs: Sequence[Any],
    config: Any,
    *,
    level: str = "aten",
    shape_facts: str | None = None,
) -> str:
    """The key of ``graph`` (fxrt IR) compiled for ``example_inputs`` under ``config``.

    ``level``: what ``graph`` is (:data:`LEVELS`). ``shape_facts``: for a graph with symbolic
    sizes, :meth:`fxrt.shapefacts.ShapeFacts.key` (symbols' ranges, replacements, guards).

    Raises:
        Unkeyable: the graph, its constants or the config cannot be fingerprinted.
    """
    h = hashlib.sha256()
    text = graph_to_text(graph)
    try:
        kernels = registry_fingerprint()
    except Unkeyable as e:
        raise Unkeyable(f"a kernel override: {e}") from None
    try:
        patterns = pattern_fingerprint()
    except Unkeyable as e:
        raise Unkeyable(f"a fused pattern: {e}") from None
    own_ops = ",".join(sorted(own_ops_available()))
    head = (
        FORMAT, MAGIC, sorted(versions().items()), config_text(config), kernels, own_ops, patterns,
        level, shape_facts,
    )  # fmt: skip
    for part in (*map(repr, head), text):
        h.update(part.encode() + b"\0")
    for node in graph.nodes:
        if node.op.kind is OpKind.PYTHON and not (
            is_trusted(node.op.target) or node.op.name.startswith("method.")  # by its name
        ):
            try:
                h.update(f"{node.name}:{fingerprint(node.op.target)}".encode())
            except Unkeyable as e:
                raise Unkeyable(f"node {node.name} calls {node.op.name}, which holds {e}") from None
    for x in example_inputs:
        h.update(_describe_input(x, shape_facts is not None).encode())
    for vid, c in graph.constants.items():
        try:
            h.update(f"{vid}:{fingerprint(c)}".encode())
        except Unkeyable as e:
            raise Unkeyable(f"constant {graph.values[vid].name} is {e}") from None
    return h.hexdigest()


def open_store(config: Any) -> Store | None:
    """The configured cache directory, or None if it is unusable (after one warning)."""
    return Store.open(cache_dir(config.cache_dir), config.cache_max_bytes)


def graph_name(graph: Any) -> str:
    """What a log line calls a graph: the user function and source line of its first node."""
    for node in graph.nodes:
        trace = node.stack_trace
        if trace:
            for line in trace.strip().splitlines():
                line = line.strip()
                if line.startswith("File "):
                    try:
                        file_part, line_part, func = line.split(", ", 2)
                        file = os.path.basename(file_part[len("File ") :].strip('"'))
                        return f"{func.removeprefix('in ')} ({file}:{line_part.split()[-1]})"
                    except ValueError:
                        break
    return f"graph of {len(graph.nodes)} ops"


def configure_logging() -> None:
    """``FXRT_LOG=info`` (or debug, warning) turns the ``fxrt`` logger on from the environment."""
    level = os.environ.get("FXRT_LOG", "").strip().upper()
    if not level:
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(
            f"environment variable FXRT_LOG={level.lower()!r}: expected debug, info, "
            "warning or error"
        )
    log.setLevel(level)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        log.addHandler(handler)


configure_logging()
