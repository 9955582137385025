"""The pattern registry: what a fused pattern is, and the process-wide list the compile pipeline's
``fuse_patterns`` stage applies.

A :class:`Pattern` has a name, the ops its anchor may be (the last op of the chain it replaces),
a matcher and its targets:

* ``match(node, index) -> Match | None`` looks at an anchor node and the graph around it
  (:class:`fxrt.patterns.match.GraphIndex`) and says what the chain computes, in the terms of one
  fused op: its arguments, the values its results stand for, and the nodes it replaces. The
  matcher says when the math is the pattern's, whatever the spelling; it decides nothing about a
  device.
* ``targets`` maps a device type (``"cpu"``, ``"npu"``, ...) to a :class:`Target`: the op that
  computes the fused op there, and a guard that says whether it applies to this match (dtype,
  layout, sizes the kernel supports). A device with no target, or a guard that says no, keeps
  the ATen ops. Targets are chosen at compile time, from the device of the match's first result.

Built-in patterns (:mod:`fxrt.patterns.builtin`) are registered the same way as a user's
(:func:`register_pattern`); ``CompilerConfig(disable_patterns=[...])`` turns any of them off by
name. The registry's content is part of the compile cache's key (:func:`registry_fingerprint`):
a user's pattern is keyed by the fingerprint of its functions, so editing one misses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir.graph import Node


@dataclass
class Match:
    """What a matcher found: one fused call that replaces ``nodes``.

    Attributes:
        args: the fused op's positional arguments (``Ref`` to graph values, :class:`View` of
            them, and constants).
        kwargs: its keyword arguments.
        results: per result of the fused op, the value id it stands for (None: a result nothing
            reads). Every reader of such a value reads the fused result instead.
        nodes: the nodes the call replaces. Those whose results nothing outside the match reads
            are removed; the fused call is placed where the last of them was.
        info: anything the matcher wants its targets' guards to see (the activation's name...).
        at: the node after which the call goes, when not the last of ``nodes`` (q's and k's
            rotary chains in one call go after q's, when a reader of q's result comes before
            k's chain ends).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    results: list[int | None]
    nodes: list[Node]
    info: dict[str, Any] = field(default_factory=dict)
    at: Node | None = None


@dataclass(frozen=True)
class View:
    """A fused call's argument that the graph does not hold: a view of graph values, made just
    before the call (``View(torch.ops.aten.transpose.int, (Ref(k), 1, 2), meta)``: K/V heads
    un-repeated in another layout than the attention reads). Only views: the node reads no data.

    Attributes:
        op: the view op (an ``OpOverload``).
        args: its arguments (``Ref`` to graph values, and constants).
        meta: the view's :class:`~fxrt.ir.graph.TensorMeta`.
    """

    op: Any
    args: tuple[Any, ...]
    meta: Any


@dataclass(frozen=True)
class Target:
    """How a device computes a pattern's fused op.

    Attributes:
        op: the op to call (an ``OpOverload``), or a function of no argument that returns it or
            None when the device's library is not there (looked up at compile time, so nothing is
            imported before a graph on that device is compiled).
        guard: ``guard(match, index) -> bool``: whether ``op`` computes this match as eager would
            (dtypes, layouts, sizes the kernel supports). Default: always.
        adapt: ``adapt(match, index) -> Match | list[Match] | None``: the call (or calls, placed
            together) in ``op``'s own terms when its schema differs from the pattern's (a vendor
            op with other arguments or more results); None when it cannot express this match.
            Default: the match as it is.
    """

    op: Any
    guard: Callable[[Match, Any], bool] | None = None
    adapt: Callable[[Match, Any], Match | list[Match] | None] | None = None

    def resolve(self) -> torch._ops.OpOverload | None:
        op = self.op
        if callable(op) and not isinstance(op, torch._ops.OpOverload):
            op = op()
        return op if isinstance(op, torch._ops.OpOverload) else None


@dataclass(frozen=True, eq=False)
class Made:
    """A fused call's argument computed just before the call, from graph values: what a target's
    :attr:`Target.adapt` builds when the device's op reads a value in another form than the
    graph holds it (a keep-mask as the vendor's masked-out mask, ``Made(torch.ops.aten
    .logical_not.default, (Ref(m),))``; a frequency table repeated per pair). Unlike a
    :class:`View` it computes: one more kernel a call, so a target uses it only where the fused
    op saves more than that.

    Attributes:
        op: the op (an ``OpOverload``).
        args: its positional arguments (``Ref``, :class:`View` or ``Made`` of graph values, and
            constants); at least one is a tensor, whose device the result is on.
        kwargs: its keyword arguments.
        meta: the result's :class:`~fxrt.ir.graph.TensorMeta`; None: worked out at compile time
            by running ``op`` on the meta device (static shapes only).

    One ``Made`` object read by several calls of one match is made once.
    """

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    meta: Any = None


@dataclass(frozen=True)
class Pattern:
    """A fused pattern (see the module docstring)."""

    name: str
    anchors: frozenset[str]  # op names ("aten::add.Tensor") the last node of the chain may have
    match: Callable[[Node, Any], Match | None]
    targets: Mapping[str, Target]
    builtin: bool = False
    doc: str = ""


_lock = threading.Lock()
_patterns: dict[str, Pattern] = {}
# Device types whose tensors take another device type's targets: a PrivateUse1 backend
# registered under its own name that runs a vendor's ops (see use_targets_of).
_families: dict[str, str] = {}


def use_targets_of(device_type: str, family: str | None) -> None:
    """Let tensors on ``device_type`` take the targets patterns name for ``family`` (e.g. a
    PrivateUse1 backend that registers ``torch_npu``'s op names: ``use_targets_of("mydev",
    "npu")``); ``family=None`` undoes it."""
    with _lock:
        if family is None:
            _families.pop(device_type, None)
        else:
            _families[device_type] = family


def target_device(device_type: str) -> str:
    """The device type whose targets tensors on ``device_type`` take."""
    return _families.get(device_type, device_type)


def register_pattern(
    name: str,
    match: Callable[[Node, Any], Match | None],
    targets: Mapping[str, Target | Any],
    *,
    anchors: Sequence[str],
    doc: str = "",
    replace: bool = False,
    _builtin: bool = False,
) -> Pattern:
    """Register a fused pattern, applied by the ``fuse_patterns`` stage of every later compile.

    Args:
        name: the pattern's name (what ``disable_patterns`` and the match counts use).
        match: ``match(node, index) -> Match | None``, called on each node whose op is one of
            ``anchors``; ``index`` is a :class:`fxrt.patterns.GraphIndex` of the graph.
        targets: device type -> :class:`Target` (or a bare op, which is ``Target(op)``).
        anchors: the op names (as the IR prints them, ``"aten::mul.Tensor"``) of the chain's last
            node.
        doc: one line on what the pattern matches.
        replace: replace a pattern of the same name (else registering it again is an error).

    Returns:
        The registered :class:`Pattern`.

    Raises:
        ValueError: the name is taken (and ``replace`` is false), or no anchor or target is given.
        TypeError: ``match`` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"fxrt: a pattern's name must be a non-empty string, got {name!r}")
    if not callable(match):
        raise TypeError(f"fxrt: pattern {name!r}: match must be callable, got {match!r}")
    if not anchors or isinstance(anchors, str):
        raise ValueError(f"fxrt: pattern {name!r}: anchors must be a non-empty list of op names")
    if not targets:
        raise ValueError(f"fxrt: pattern {name!r}: give at least one device target")
    made = {
        device: t if isinstance(t, Target) else Target(t) for device, t in dict(targets).items()
    }
    pattern = Pattern(name, frozenset(anchors), match, made, _builtin, doc)
    with _lock:
        if name in _patterns and not replace:
            raise ValueError(
                f"fxrt: a pattern named {name!r} is registered already; pass replace=True to "
                "replace it, or unregister_pattern() it first"
            )
        _patterns[name] = pattern
    return pattern


def unregister_pattern(name: str) -> None:
    """Remove a pattern (a user's or a built-in one; built-ins are better turned off per compile
    with ``disable_patterns``).

    Raises:
        KeyError: no pattern has that name.
    """
    with _lock:
        if name not in _patterns:
            raise KeyError(f"fxrt: no pattern named {name!r}; registered: {', '.join(_patterns)}")
        del _patterns[name]


def registered_patterns() -> dict[str, Pattern]:
    """The registered patterns by name, in the order they are tried."""
    with _lock:
        return dict(_patterns)


def registry_fingerprint() -> str:
    """What the cache key holds of the registry: each pattern's name, and for a user's pattern
    the fingerprint of its matcher and targets.

    Raises:
        fxrt.fingerprint.Unkeyable: a user pattern's function cannot be fingerprinted.
    """
    from ..fingerprint import fingerprint

    parts = []
    for name, p in registered_patterns().items():
        if p.builtin:
            parts.append(name)
            continue
        targets = {d: (t.op, t.guard, t.adapt) for d, t in p.targets.items()}
        parts.append(f"{name}:{fingerprint(p.match)}:{fingerprint(targets)}")
    return ";".join(parts)


__all__ = [
    "Made",
    "Match",
    "Pattern",
    "Target",
    "register_pattern",
    "registered_patterns",
    "registry_fingerprint",
    "target_device",
    "unregister_pattern",
    "use_targets_of",
]
