"""Per-call binding and checks of a loaded package (:class:`Binder`).

Each call:

1. flattens ``(args, kwargs)`` (directly, when the call is positional leaves only, as it was
   exported), keyword arguments reordered to the exported order; another structure raises
   :class:`fxrt.InputError` describing both;
2. checks what the compiled graph does not (:meth:`Binder.quick`, whose C++ twin in the compiled
   loop's extension, ``package_checks.h``, checks the calls that go straight to the loop; see
   :meth:`Binder.tables`): each size symbol within its
   exported ``Dim`` range, each constant equal to the exported one, derived sizes, and each int
   input (a SymInt of the graph: an int, within its symbol's range, equal to the value a tensor
   dimension bound the symbol to); derived sizes are computed by functions compiled once
   (:mod:`fxrt.deploy.size_expr`, the C++ runtime's arithmetic), not sympy. Dtypes, devices,
   ranks, static sizes, strides and symbols bound consistently across inputs are checked by the
   compiled graph itself (:mod:`fxrt.exec.inputs`, in C++ on the compiled loop); when it
   refuses a call, :meth:`Binder.check` runs to name the input: its parameter name and path, the
   dimension, the symbol (and its ``Dim`` name) and the range;
3. hands the leaves to :class:`fxrt.deploy.python_loader.PythonLoadedModel`, which puts the
   weights in front.

On the C++ runtime (:mod:`fxrt.deploy.runtime_model`) only :meth:`Binder.flatten` and
:meth:`Binder.check_constants` run: the runtime checks the values itself, with these words.

A Binder is built once per loaded package and holds no per-call state, so threads share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..exec.inputs import InputError
from .signature import SYMBOL, InputSig, Signature, range_text
from .size_expr import SizeFn, compile_size


class Binder:
    """Turns ``(args, kwargs)`` into the graph's user inputs, checking them (see the module
    docstring). Built once per loaded package; stateless per call, so threads may share it."""

    def __init__(self, sig: Signature, in_spec: pytree.TreeSpec, device: torch.device | None):
        self.sig = sig
        self.in_spec = in_spec
        users = sig.user_inputs()
        self.n_leaves = len(users)
        self.kwarg_names: tuple[str, ...] = ()
        self.n_args = -1
        children = _children(in_spec)
        if in_spec.type is tuple and len(children) == 2 and children[1].type is dict:
            args_spec, kw_spec = children
            self.kwarg_names = tuple(kw_spec.context)
            # The call is positional leaves only: flatten by taking args as they are.
            if (
                args_spec.type is tuple
                and not self.kwarg_names
                and all(c.is_leaf() for c in _children(args_spec))
            ):
                self.n_args = args_spec.num_children
        self.tensors: list[tuple[int, InputSig, torch.dtype, torch.device, tuple[Any, ...]]] = []
        self.constants: list[tuple[int, InputSig]] = []
        self.derived: list[tuple[int, InputSig, int, SizeFn]] = []  # (leaf, sig, dim, size)
        self.symints: list[tuple[int, InputSig]] = []
        for leaf, s in enumerate(users):
            if s.kind == "tensor":
                dims = []
                for d, size in enumerate(s.shape):
                    if isinstance(size, int):
                        dims.append((d, size, None))
                    elif size in sig.ranges or SYMBOL.fullmatch(size):
                        dims.append((d, size, sig.ranges.get(size, (0, None))))
                    else:
                        self.derived.append((leaf, s, d, compile_size(size)))
                dev = torch.device(s.device) if device is None else device
                self.tensors.append((leaf, s, getattr(torch, s.dtype), dev, tuple(dims)))
            elif s.kind == "constant":
                self.constants.append((leaf, s))
            else:
                self.symints.append((leaf, s))
        # Int inputs whose value is a derived expression (not a bare symbol): checked once the
        # symbols are bound.
        self.derived_ints = [
            (leaf, s, compile_size(s.shape[0]))
            for leaf, s in self.symints
            if not (s.shape[0] in sig.ranges or SYMBOL.fullmatch(s.shape[0]))
        ]
        # What each call checks before the graph runs: the ranges of symbolic sizes and the
        # constants. Dtypes, devices, ranks, static sizes, strides and symbols bound
        # consistently are checked by the compiled graph itself (fxrt.exec.inputs, in C++ on
        # the compiled loop); when it refuses a call, :meth:`check` runs to name the input.
        self.ranged = tuple(
            (leaf, tuple((d, r[0], 2**63 if r[1] is None else r[1]) for d, _, r in dims if r))
            for leaf, _, _, _, dims in self.tensors
            if any(r is not None for _, _, r in dims)
        )
        self.constant_values = tuple((leaf, s.value) for leaf, s in self.constants)
        # With int inputs or derived sizes, each call binds the symbols where they first appear
        # (a tensor dim, an int input) and checks the int inputs and derived sizes against them.
        sites: dict[str, tuple[int, int | None]] = {}
        for leaf, _, _, _, dims in self.tensors:
            for d, want, rng in dims:
                if rng is not None:
                    sites.setdefault(want, (leaf, d))
        self.int_checks = []
        for leaf, s in self.symints:
            want = s.shape[0]
            if want in sig.ranges or SYMBOL.fullmatch(want):
                sites.setdefault(want, (leaf, None))
                lo, hi = sig.ranges.get(want, (0, None))
                self.int_checks.append((leaf, want, lo, 2**63 if hi is None else hi))
        self.sites = tuple((sym, leaf, d) for sym, (leaf, d) in sites.items())
        self.needs_quick = bool(self.ranged or self.constant_values or self.derived or self.symints)

    def tables(self) -> tuple[list, list, list, list]:
        """What :meth:`quick` checks, as the compiled loop's twin of it takes it (its
        ``package_checks.h``; without derived sizes): ``(leaf, dim, lo, hi)`` per ranged size,
        ``(leaf, value)`` per constant, ``(symbol, leaf, dim or -1)`` per place a symbol is
        bound, ``(leaf, symbol, lo, hi)`` per int input; symbols by number, bounds in int64."""
        top = 2**63 - 1
        syms = {sym: k for k, (sym, _, _) in enumerate(self.sites)}
        ranges = [(leaf, d, lo, min(hi, top)) for leaf, dims in self.ranged for d, lo, hi in dims]
        sites = [(syms[sym], leaf, -1 if d is None else d) for sym, leaf, d in self.sites]
        ints = [(leaf, syms[w], lo, min(hi, top)) for leaf, w, lo, hi in self.int_checks]
        return ranges, list(self.constant_values), sites, ints

    # -- structure

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Sequence[Any]:
        if not kwargs and len(args) == self.n_args:
            return args
        if kwargs and tuple(kwargs) != self.kwarg_names and set(kwargs) == set(self.kwarg_names):
            kwargs = {k: kwargs[k] for k in self.kwarg_names}
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise InputError(
                "fxrt: the call's arguments do not have the exported structure: exported "
                f"{_call_text(self.in_spec)}, called with {_call_text(spec)}"
            )
        return leaves

    # -- values

    def quick(self, leaves: Sequence[Any]) -> None:
        """The per-call check (ranges, constants); on any doubt the full :meth:`check` runs and
        raises the named error."""
        try:
            for leaf, dims in self.ranged:
                shape = leaves[leaf].shape
                for d, lo, hi in dims:
                    n = shape[d]
                    if n < lo or n > hi:
                        raise _Mismatch
            for leaf, value in self.constant_values:
                x = leaves[leaf]
                if type(x) is not type(value) or x != value:
                    raise _Mismatch
            if self.derived or self.symints:
                self._quick_sizes(leaves)
        except (_Mismatch, AttributeError, IndexError, TypeError):
            self.check(leaves)
            raise InputError("fxrt: the call's inputs do not match the exported ones") from None

    def _quick_sizes(self, leaves: Sequence[Any]) -> None:
        env = {}
        for sym, leaf, d in self.sites:
            x = leaves[leaf]
            env[sym] = x if d is None else x.shape[d]
        for leaf, want, lo, hi in self.int_checks:
            x = leaves[leaf]
            if type(x) is not int or x < lo or x > hi or env[want] != x:
                raise _Mismatch
        for leaf, _, d, size in self.derived:
            want = size(env)
            if want is not None and leaves[leaf].shape[d] != want:
                raise _Mismatch
        for leaf, _, size in self.derived_ints:
            x = leaves[leaf]
            want = size(env)
            if type(x) is not int or (want is not None and x != want):
                raise _Mismatch

    def check(self, leaves: Sequence[Any]) -> None:
        """Raise :class:`fxrt.InputError` for the first leaf that does not match."""
        bound: dict[str, tuple[int, InputSig, int]] = {}
        for leaf, s, dtype, device, dims in self.tensors:
            x = leaves[leaf]
            if not isinstance(x, torch.Tensor):
                raise self._error(s, f"expected a tensor, got a {type(x).__name__}")
            if x.dtype != dtype:
                raise self._error(s, f"dtype {_dt(x.dtype)}, exported for {s.dtype}", x)
            if x.device != device:
                raise self._error(s, f"device {x.device}, exported for {device}", x)
            shape = x.shape
            if len(shape) != len(s.shape):
                raise self._error(s, f"{len(shape)} dims, exported for {len(s.shape)}", x)
            for d, want, rng in dims:
                got = shape[d]
                if rng is None:
                    if got != want:
                        raise self._error(
                            s, f"dim {d}: size {got}, exported for {want} (static)", x
                        )
                    continue
                lo, hi = rng
                if got < lo or (hi is not None and got > hi):
                    raise self._error(
                        s,
                        f"dim {d}: size {got} is outside the range of {self.sig.sym(want)}, "
                        f"{range_text(rng)}",
                        x,
                    )
                prev = bound.get(want)
                if prev is None:
                    bound[want] = (got, s, d)
                elif prev[0] != got:
                    raise self._error(
                        s,
                        f"dim {d}: size {got}, but {self.sig.sym(want)} = {prev[0]} from "
                        f"{prev[1].label()} dim {prev[2]}",
                        x,
                    )
        self.check_constants(leaves)
        # Int inputs after the tensors: a bare symbol is checked against its range and binds it
        # (or must equal the value a tensor dim bound it to); a derived one is checked below.
        for leaf, s in self.symints:
            x = leaves[leaf]
            if not isinstance(x, int) or isinstance(x, bool):
                raise self._error(s, f"expected an int, got a {type(x).__name__}")
            want = s.shape[0]
            if not (want in self.sig.ranges or SYMBOL.fullmatch(want)):
                continue
            rng = self.sig.ranges.get(want, (0, None))
            if x < rng[0] or (rng[1] is not None and x > rng[1]):
                raise self._error(
                    s, f"{x} is outside the range of {self.sig.sym(want)}, {range_text(rng)}"
                )
            prev = bound.get(want)
            if prev is None:
                bound[want] = (x, s, None)
            elif prev[0] != x:
                where = "" if prev[2] is None else f" dim {prev[2]}"
                raise self._error(
                    s, f"{x}, but {self.sig.sym(want)} = {prev[0]} from {prev[1].label()}{where}"
                )
        if self.derived or self.symints:
            self._check_derived(leaves, bound)

    def check_constants(self, leaves: Sequence[Any]) -> None:
        """Raise :class:`fxrt.InputError` for the first constant that is not the exported one."""
        for leaf, s in self.constants:
            x = leaves[leaf]
            if type(x) is not type(s.value) or x != s.value:
                raise self._error(s, f"exported with the constant {s.value!r}, got {x!r}")

    def _check_derived(self, leaves: Sequence[Any], bound: dict[str, Any]) -> None:
        env = {k: v[0] for k, v in bound.items()}
        for leaf, s, d, size in self.derived:
            x = leaves[leaf]
            want = size(env)
            if want is not None and x.shape[d] != want:
                raise self._error(
                    s, f"dim {d}: size {x.shape[d]}, expected {s.shape[d]} = {want}", x
                )
        for leaf, s, size in self.derived_ints:
            x = leaves[leaf]
            want = size(env)
            if want is not None and x != want:
                raise self._error(s, f"{x}, expected {s.shape[0]} = {want}")

    def _error(self, s: InputSig, what: str, x: Any = None) -> InputError:
        got = "" if x is None else f"; got {_describe(x)}"
        exported = f" (exported: {s.describe(self.sig)}{got})" if s.kind == "tensor" else ""
        return InputError(f"fxrt: {s.label()}: {what}{exported}")


class _Mismatch(Exception):
    pass


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _describe(x: Any) -> str:
    if not isinstance(x, torch.Tensor):
        return repr(x)[:60]
    dev = "" if x.device.type == "cpu" else f"@{x.device}"
    return f"{_dt(x.dtype)}[{', '.join(str(s) for s in x.shape)}]{dev}"


def _call_text(spec: pytree.TreeSpec) -> str:
    try:
        args, kwargs = pytree.tree_unflatten(["*"] * spec.num_leaves, spec)
        parts = [_tree_text(a) for a in args] + [f"{k}={_tree_text(v)}" for k, v in kwargs.items()]
        return "(" + ", ".join(parts) + ")"
    except Exception:
        return str(spec)


def _tree_text(x: Any) -> str:
    return "*" if x == "*" else str(x).replace("'*'", "*")


__all__ = ["Binder"]
