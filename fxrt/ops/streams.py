"""Stream scopes and events as graph ops, with TorchAir's schemas.

A graph says which stream an op runs on, and how streams wait for one another, with four ops::

    fxrt::scope_enter(str[] keys, str[] values, bool need_execute=False) -> ()
    fxrt::scope_exit(bool need_execute=False) -> ()
    fxrt::record(*, Device? device=None) -> Tensor      # an event token
    fxrt::wait(Tensor[] events) -> ()

``scope_enter`` opens a scope whose stream is the value of the key ``_user_stream_label``
(``_user_stream_priority`` is accepted and ignored: fxrt's streams have one priority); the ops
up to the matching ``scope_exit`` run on that stream. ``record`` marks the point its stream has
reached; ``wait`` makes its stream wait until every event it names was reached. These are the
schemas of TorchAir's ``air::`` ops, which fxrt runs the same way: when TorchAir is not installed,
:func:`register_torchair_compat` defines them under ``air`` so that a graph pass written for
TorchAir runs unchanged.

In eager mode the ops do nothing (``record`` returns an empty tensor), and so do the model-code
helpers :func:`stream_scope`, :func:`record` and :func:`wait` outside ``torch.compile``. They
are marked side-effectful so that no dead-code elimination (FX's, AOTAutograd's or fxrt's)
drops them. What a stream is and how a program runs on several is
:mod:`fxrt.analysis.streams` (the IR), :mod:`fxrt.passes.synchronize_streams` (ordering) and
:mod:`fxrt.exec.streams` (the executors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx.node

LABEL_KEY = "_user_stream_label"
PRIORITY_KEY = "_user_stream_priority"

_SCHEMAS = {
    "scope_enter": "scope_enter(str[] keys, str[] values, bool need_execute=False) -> ()",
    "scope_exit": "scope_exit(bool need_execute=False) -> ()",
    "record": "record(*, Device? device=None) -> Tensor",
    "wait": "wait(Tensor[] events) -> ()",
}
NAMESPACES = ("fxrt", "air")

# Op names (``ns::name``) of every stream op fxrt knows, by role.
SCOPE_ENTER = frozenset(f"{ns}::scope_enter" for ns in NAMESPACES)
SCOPE_EXIT = frozenset(f"{ns}::scope_exit" for ns in NAMESPACES)
RECORD = frozenset(f"{ns}::record" for ns in NAMESPACES)
WAIT = frozenset(f"{ns}::wait" for ns in NAMESPACES)
STREAM_OPS = SCOPE_ENTER | SCOPE_EXIT | RECORD | WAIT


def _scope_enter(keys: Sequence[str], values: Sequence[str], need_execute: bool = False) -> None:
    return None


def _scope_exit(need_execute: bool = False) -> None:
    return None


def _record(*, device: torch.device | None = None) -> torch.Tensor:
    return torch.empty(0, device=device)


def _wait(events: Sequence[torch.Tensor]) -> None:
    return None


_IMPLS = {"scope_enter": _scope_enter, "scope_exit": _scope_exit, "record": _record, "wait": _wait}
_libraries: dict[str, torch.library.Library] = {}


def _defined(ns: str, name: str) -> bool:
    try:
        return getattr(getattr(torch.ops, ns), name) is not None
    except (AttributeError, RuntimeError):
        return False


def _define(ns: str) -> None:
    lib = torch.library.Library(ns, "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        if _defined(ns, name):
            continue
        lib.define(schema)
        lib.impl(name, _IMPLS[name], "CompositeExplicitAutograd")
    _libraries[ns] = lib
    _mark_side_effectful(ns)


def _mark_side_effectful(ns: str) -> None:
    for name in _SCHEMAS:
        if _defined(ns, name):
            packet = getattr(getattr(torch.ops, ns), name)
            torch.fx.node._side_effectful_functions.add(packet.default)


def register_torchair_compat() -> bool:
    """Define TorchAir's stream ops under ``air`` (``torch.ops.air.scope_enter``...) unless they
    exist already (TorchAir imported, or an earlier call): a graph pass written for TorchAir then
    runs unchanged through fxrt. Returns True when it defined them."""
    if "air" in _libraries:
        return False
    if all(_defined("air", name) for name in _SCHEMAS):
        _mark_side_effectful("air")
        return False
    _define("air")
    return True


_define("fxrt")
scope_enter = torch.ops.fxrt.scope_enter.default
scope_exit = torch.ops.fxrt.scope_exit.default
record_op = torch.ops.fxrt.record.default
wait_op = torch.ops.fxrt.wait.default


def is_stream_op(name: str) -> bool:
    """Whether the op named ``ns::name`` is one of the stream ops (fxrt's or TorchAir's)."""
    return name in STREAM_OPS


@contextlib.contextmanager
def stream_scope(label: str) -> Iterator[None]:
    """Run the ops of the block on the stream named ``label`` (TorchAir's ``npu_stream_switch``).

    Under ``torch.compile`` with fxrt, the block's ops are put between ``fxrt::scope_enter`` and
    ``fxrt::scope_exit``; in eager mode it does nothing. Values made in the block and used after
    it (or values made before it and used in it) are synchronized by fxrt, which inserts the
    missing :func:`record`/:func:`wait` pairs (or raises with ``strict_streams``).

    Example::

        def forward(self, x):
            with fxrt.stream_scope("expert1"):
                a = self.expert1(x)
                ev = fxrt.record()
            b = self.expert0(x)
            fxrt.wait([ev])
            return a + b
    """
    if not isinstance(label, str) or not label:
        raise ValueError(f"fxrt.stream_scope: a stream label is a non-empty str, got {label!r}")
    compiling = torch.compiler.is_compiling()
    if compiling:
        scope_enter([LABEL_KEY], [label])
    try:
        yield
    finally:
        if compiling:
            scope_exit()


def record(device: Any = None) -> torch.Tensor | None:
    """An event on the current stream (``fxrt::record``) under ``torch.compile``; None in eager
    mode, where there is one stream."""
    if torch.compiler.is_compiling():
        return record_op(device=device)
    return None


def wait(events: Sequence[torch.Tensor | None]) -> None:
    """Make the current stream wait for ``events`` (``fxrt::wait``) under ``torch.compile``;
    nothing in eager mode."""
    if torch.compiler.is_compiling():
        evs = [e for e in events if e is not None]
        if evs:
            wait_op(evs)


def stream_label(keys: Sequence[str], values: Sequence[str]) -> str | None:
    """The stream label a ``scope_enter(keys, values)`` names, or None when it names none."""
    for k, v in zip(keys, values):
        if k == LABEL_KEY:
            return str(v)
    return None


__all__ = [
    "LABEL_KEY",
    "PRIORITY_KEY",
    "RECORD",
    "SCOPE_ENTER",
    "SCOPE_EXIT",
    "STREAM_OPS",
    "WAIT",
    "is_stream_op",
    "record",
    "record_op",
    "register_torchair_compat",
    "scope_enter",
    "scope_exit",
    "stream_label",
    "stream_scope",
    "wait",
    "wait_op",
]
