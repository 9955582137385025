"""Convert an fxrt :class:`Graph` back to an FX GraphModule (for user post passes and dumps).

Each FX node carries the fxrt :class:`Value` it came from in ``meta["fxrt_value"]``, which
:func:`from_fx` reads back when a node has no ``meta["val"]``; multi-output nodes get one
``operator.getitem`` per output.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from .graph import Graph, Ref, map_refs


def to_fx(graph: Graph) -> torch.fx.GraphModule:
    root = torch.nn.Module()
    fx = torch.fx.Graph()
    env: dict[int, torch.fx.Node] = {}

    def tag(node: torch.fx.Node, vid: int) -> torch.fx.Node:
        node.meta["fxrt_value"] = graph.values[vid]
        env[vid] = node
        return node

    for vid in graph.inputs:
        tag(fx.placeholder(graph.values[vid].name), vid)
    for vid, obj in graph.constants.items():
        name = f"_fxrt_const_{vid}"
        if isinstance(obj, torch.nn.Module):
            root.add_module(name, obj)
        else:
            setattr(root, name, obj)
        tag(fx.get_attr(name), vid)

    def load(r: Ref) -> Any:
        return env[r.id]

    for node in graph.nodes:
        args, kwargs = map_refs(node.args, load), map_refs(node.kwargs, load)
        call = fx.create_node("call_function", node.op.target, args, kwargs, name=node.name)
        if node.stack_trace:
            call.meta["stack_trace"] = node.stack_trace
        if node.multi:
            for i, vid in enumerate(node.outputs):
                tag(fx.call_function(operator.getitem, (call, i)), vid)
        else:
            tag(call, node.outputs[0])
    fx.output(map_refs(graph.output, load))
    return torch.fx.GraphModule(root, fx)
