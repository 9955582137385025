"""Readable text for a :class:`Graph`; the canonical form golden tests and cache keys use."""

from __future__ import annotations

from typing import Any

import torch

from .graph import Graph, Node, Ref, Value


def format_arg(a: Any, names: dict[int, str] | None = None) -> str:
    if isinstance(a, Ref):
        return f"%{names[a.id]}" if names else repr(a)
    if isinstance(a, list):
        return "[" + ", ".join(format_arg(x, names) for x in a) + "]"
    if isinstance(a, tuple):
        inner = ", ".join(format_arg(x, names) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {format_arg(v, names)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.dtype):
        return str(a).removeprefix("torch.")
    if isinstance(a, torch.Tensor):
        return f"tensor<{str(a.dtype).removeprefix('torch.')}{list(a.shape)}>"
    if isinstance(a, torch.nn.Module):
        return f"<{type(a).__name__}>"
    return repr(a)


def format_call(name: str, args: tuple, kwargs: dict, names: dict[int, str] | None = None) -> str:
    parts = [format_arg(a, names) for a in args]
    parts += [f"{k}={format_arg(v, names)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def value_decl(v: Value) -> str:
    """``%name: type``, as a value is declared in the text of its graph."""
    typ = str(v.meta) if v.meta is not None else (v.expr and f"sym {v.expr}") or v.kind.value
    return f"%{v.name}: {typ}"


def node_line(node: Node, values: list[Value], names: dict[int, str]) -> str:
    """The line of ``node`` in the text of its graph (without the indent)."""
    outs = ", ".join(value_decl(values[v]) for v in node.outputs)
    if node.multi:
        outs = f"({outs})"
    return f"{outs} = {format_call(node.op.name, node.args, node.kwargs, names)}"


def graph_to_text(graph: Graph) -> str:
    """One line per input, constant and node; values print as ``%name: type``."""
    names = {v.id: v.name for v in graph.values}
    values = graph.values
    lines = ["graph(" + ", ".join(value_decl(values[v]) for v in graph.inputs) + "):"]
    for vid, c in graph.constants.items():
        lines.append(f"  {value_decl(values[vid])} = constant {format_arg(c)}")
    for node in graph.nodes:
        lines.append("  " + node_line(node, values, names))
    lines.append(f"  return {format_arg(graph.output, names)}")
    return "\n".join(lines)
