"""The call's structure for a loaded package (:class:`Binder`): what the C++ runtime cannot see.

Each call made other than as exported (positional leaves only) is flattened here: ``(args,
kwargs)`` to the exported leaves, keyword arguments reordered to the exported order; another
structure raises :class:`fxrt.InputError` describing both. The constants the export specialized
on (a Python number it did not keep symbolic) are compared here and left out. Every value the
program receives (dtypes, devices, sizes, symbol ranges, derived sizes, int inputs) the runtime
checks (``csrc/src/inputs.cpp``), naming the input as :meth:`Binder.check_constants` does.

A Binder is built once per loaded package and holds no per-call state, so threads share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..exec.inputs import InputError
from .signature import InputSig, Signature


class Binder:
    """Turns ``(args, kwargs)`` into the exported call's leaves (see the module docstring)."""

    def __init__(self, sig: Signature, in_spec: pytree.TreeSpec):
        self.sig = sig
        self.in_spec = in_spec
        self.kwarg_names: tuple[str, ...] = ()
        self.n_args = -1  # the call is this many positional leaves, or -1
        children = _children(in_spec)
        if in_spec.type is tuple and len(children) == 2 and children[1].type is dict:
            args_spec, kw_spec = children
            self.kwarg_names = tuple(kw_spec.context)
            if (
                args_spec.type is tuple
                and not self.kwarg_names
                and all(c.is_leaf() for c in _children(args_spec))
            ):
                self.n_args = args_spec.num_children
        users = sig.user_inputs()
        self.constants = [(leaf, s) for leaf, s in enumerate(users) if s.kind == "constant"]

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

    def check_constants(self, leaves: Sequence[Any]) -> None:
        """Raise :class:`fxrt.InputError` for the first constant that is not the exported one."""
        for leaf, s in self.constants:
            x = leaves[leaf]
            if type(x) is not type(s.value) or x != s.value:
                raise self._error(s, f"exported with the constant {s.value!r}, got {x!r}")

    def _error(self, s: InputSig, what: str, x: Any = None) -> InputError:
        got = "" if x is None else f"; got {_describe(x)}"
        exported = f" (exported: {s.describe(self.sig)}{got})" if s.kind == "tensor" else ""
        return InputError(f"fxrt: {s.label()}: {what}{exported}")


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
