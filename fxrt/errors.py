"""Errors fxrt raises, and the message both loops give when an op fails."""

from __future__ import annotations

from typing import Any

import torch


class ExecutionError(RuntimeError):
    """An op failed while a compiled graph ran. The message names the FX node, the op, the input
    shapes and dtypes and the user's source line; the original exception is chained."""


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
) -> ExecutionError:
    """Build the ExecutionError for a failed node; the caller raises it ``from exc``."""
    lines = [
        f"node '{node_name}' ({op_name}) failed: {type(exc).__name__}: {exc}".rstrip(),
        "  inputs: " + (", ".join(describe_value(x) for x in inputs) or "none"),
    ]
    if stack_trace:
        lines.append("  from user code:")
        lines += ["    " + ln for ln in stack_trace.strip().splitlines()[-4:]]
    return ExecutionError("\n".join(lines))
