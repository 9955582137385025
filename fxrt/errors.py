"""Errors fxrt raises, and the one builder both loops use when an instruction fails."""

from __future__ import annotations

from typing import Any

import torch

from .ir.graph import Ref, map_refs, refs_in


class ExecutionError(RuntimeError):
    """An op failed while a compiled graph ran. The message names the FX node, the op, the input
    shapes and dtypes and the user's source line; the original exception is chained.

    The exception raised is also of the original exception's type (an ``IndexError`` from an
    embedding lookup is caught by ``except IndexError`` as in eager, and by
    ``except fxrt.ExecutionError``): its class derives from both."""


_combined: dict[type, type] = {}


def _with_original_type(exc_type: type[BaseException]) -> type[ExecutionError] | None:
    """``ExecutionError`` joined with ``exc_type`` (cached), or None where Python cannot join
    them (a built-in type with another instance layout, a non-Exception)."""
    if issubclass(exc_type, ExecutionError) or not issubclass(exc_type, Exception):
        return None
    if exc_type is RuntimeError:
        return ExecutionError
    if exc_type not in _combined:
        try:
            _combined[exc_type] = type(
                exc_type.__name__,
                (ExecutionError, exc_type),
                {"__module__": exc_type.__module__, "__doc__": ExecutionError.__doc__},
            )
        except TypeError:
            _combined[exc_type] = None  # type: ignore[assignment]
    return _combined[exc_type]


def describe_value(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        dt = str(x.dtype).removeprefix("torch.")
        dev = "" if x.device.type == "cpu" else f"@{x.device}"
        return f"{dt}[{', '.join(str(s) for s in x.shape)}]{dev}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(describe_value(y) for y in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if x is None or isinstance(x, (int, float, bool, str, torch.SymInt, torch.dtype)):
        return repr(x)
    return type(x).__name__


def node_error(
    node_name: str, op_name: str, stack_trace: str | None, inputs: list[Any], exc: BaseException
) -> BaseException:
    """Build the exception for a failed node; the caller raises it ``from exc``: an
    ExecutionError of the original type, or where Python cannot make one, ``exc`` itself with
    the message as a note."""
    lines = [
        f"node '{node_name}' ({op_name}) failed: {type(exc).__name__}: {exc}".rstrip(),
        "  inputs: " + (", ".join(describe_value(x) for x in inputs) or "none"),
    ]
    if stack_trace:
        lines.append("  from user code:")
        lines += ["    " + ln for ln in stack_trace.strip().splitlines()[-4:]]
    message = "\n".join(lines)
    cls = _with_original_type(type(exc))
    if cls is not None:
        try:
            return cls(message)
        except TypeError:  # a constructor that wants other arguments
            pass
    if isinstance(exc, Exception) and not isinstance(exc, ExecutionError):
        exc.add_note(message)  # keep the type the caller catches; the note names the node
        return exc
    return ExecutionError(message)


def has_refs(a: Any) -> bool:
    """Whether an argument reads registers (a Ref, or a container holding one)."""
    return isinstance(a, (Ref, list, tuple, dict, slice)) and bool(refs_in(a))


def instruction_error(program: Any, pc: int, regs: list[Any], exc: BaseException) -> BaseException:
    """The exception a loop raises (``from exc``) when instruction ``pc`` of ``program`` failed
    with ``exc``; ``regs`` is the register file at that point. Both loops call this."""
    ins = program.code[pc]
    if not hasattr(ins, "node"):  # a FREE cannot fail but by a bug: keep the original
        return exc
    info = program.nodes[ins.node]
    args = [
        map_refs(a, lambda ref: regs[ref.id])
        for a in (*ins.args, *ins.kwargs.values())
        if has_refs(a)
    ]
    return node_error(info.name, info.op, info.stack_trace, args, exc)
