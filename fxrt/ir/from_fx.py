"""Convert an ATen-level ``torch.fx.GraphModule`` into an fxrt :class:`Graph`.

The mapping is direct, node for node:

* ``placeholder`` -> a graph input; ``get_attr`` -> a constant the graph owns (tensors, parameters,
  submodules of higher-order ops);
* ``call_function`` on an ``OpOverload`` -> an ATen node; any other callable (``operator.mul`` on
  SymInts, higher-order ops, Python functions) -> a Python fallback node; ``call_method`` and
  ``call_module`` also become fallbacks;
* ``operator.getitem`` on a node that returns a sequence does not become a node: the producer is
  marked ``multi`` and gets one output value per element, and the getitem reads that element.
  A sequence-returning node used whole (say ``split`` fed straight into ``cat``) is passed on as a
  list of its element refs;
* ``output`` -> ``Graph.output``, keeping the FX output's nesting.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from .graph import Graph, Node, Op, OpKind, Ref, TensorMeta, ValueKind


class ConversionError(ValueError):
    """The FX graph has a construct fxrt cannot represent."""


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    def dims(xs: Sequence[Any]) -> tuple[int | str, ...]:
        if all(type(x) is int for x in xs):  # static sizes, the common case: nothing to convert
            return tuple(xs)
        return tuple(int(x) if _is_static_int(x) else str(x) for x in xs)

    try:
        raw = t.untyped_storage().nbytes()
        nbytes: int | str | None = int(raw) if _is_static_int(raw) else str(raw)
    except Exception:  # sparse, nested, or storage-less tensor subclasses
        nbytes = None
    return TensorMeta(
        dims(t.shape),
        dims(t.stride()) if t.layout == torch.strided else (),
        t.dtype,
        str(t.device),
        nbytes,
    )


def _is_static_int(x: Any) -> bool:
    if isinstance(x, int):
        return True
    if isinstance(x, torch.SymInt):
        return x.node.is_constant() or x.node.maybe_as_int() is not None
    return False


def _example(node: torch.fx.Node) -> Any:
    for key in ("val", "example_value"):
        if key in node.meta:
            return node.meta[key]
    return None


def _sequence_length(node: torch.fx.Node) -> int | None:
    """How many values ``node`` returns if it returns a fixed-length sequence, else None."""
    target = node.target
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        returns = target._schema.returns
        if len(returns) > 1:
            return len(returns)
        if len(returns) == 0 or not isinstance(returns[0].type, torch.ListType):
            return None
    ex = _example(node)
    if isinstance(ex, (list, tuple)):
        return len(ex)
    users = list(node.users)
    if users and all(
        u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
        for u in users
    ):
        return max(u.args[1] for u in users) + 1
    return None


def _copied_instead_of_aliasing(node: torch.fx.Node, op: Op) -> bool:
    """For an op whose schema lets its result alias an input but which is free to copy instead
    (a CompositeImplicitAutograd op such as ``reshape``), whether the traced result is a copy."""
    if op.kind is not OpKind.ATEN or node.op != "call_function":
        return False
    ret = op.target._schema.returns
    if len(ret) != 1 or ret[0].alias_info is None or ret[0].alias_info.is_write:
        return False
    if not torch._C._dispatch_has_kernel_for_dispatch_key(
        op.target.name(), "CompositeImplicitAutograd"
    ):
        return False
    out = _example(node)
    ins = [_example(a) for a in node.all_input_nodes]
    if not isinstance(out, torch.Tensor) or not all(isinstance(x, torch.Tensor) for x in ins):
        return False
    from torch.multiprocessing.reductions import StorageWeakRef

    mine = StorageWeakRef(out.untyped_storage())
    return all(StorageWeakRef(x.untyped_storage()) != mine for x in ins)


class _Converter:
    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any] | None):
        self.gm = gm
        self.examples = list(example_inputs) if example_inputs is not None else None
        self.graph = Graph()
        self.env: dict[torch.fx.Node, Any] = {}  # FX node -> Ref, or list of Refs for sequences
        self.n_placeholders = 0

    def value_for(self, name: str, ex: Any, node: torch.fx.Node | None = None) -> int:
        g = self.graph
        known = node.meta.get("fxrt_value") if node is not None and ex is None else None
        if known is not None:  # a node to_fx made: keep what fxrt knew about it
            return g.add_value(name, known.kind, known.meta, known.expr)
        if isinstance(ex, torch.Tensor):
            return g.add_value(name, ValueKind.TENSOR, tensor_meta(ex))
        if isinstance(ex, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return g.add_value(name, ValueKind.SYM, expr=str(ex))
        if isinstance(ex, (int, float, bool)):
            return g.add_value(name, ValueKind.SCALAR)
        if ex is None and node is not None and "val" in node.meta:
            return g.add_value(name, ValueKind.NONE)
        return g.add_value(name, ValueKind.OTHER)

    def arg(self, a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return self.env[a]
        if isinstance(a, (list, tuple)):  # also FX's immutable_list
            seq = [self.arg(x) for x in a]
            return tuple(seq) if isinstance(a, tuple) else seq
        if isinstance(a, dict):
            return {k: self.arg(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(self.arg(a.start), self.arg(a.stop), self.arg(a.step))
        return a

    def run(self) -> Graph:
        for node in self.gm.graph.nodes:
            getattr(self, "on_" + node.op)(node)
        return self.graph

    def on_placeholder(self, node: torch.fx.Node) -> None:
        ex = _example(node)
        if ex is None and self.examples is not None and self.n_placeholders < len(self.examples):
            ex = self.examples[self.n_placeholders]
        self.n_placeholders += 1
        vid = self.value_for(node.name, ex, node)
        self.graph.inputs.append(vid)
        self.env[node] = Ref(vid)

    def on_get_attr(self, node: torch.fx.Node) -> None:
        obj: Any = self.gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        vid = self.value_for(node.name, obj)
        self.graph.constants[vid] = obj
        self.env[node] = Ref(vid)

    def on_call_function(self, node: torch.fx.Node) -> None:
        target = node.target
        if target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            src = self.env[node.args[0]]
            if isinstance(src, list) and isinstance(node.args[1], int):
                self.env[node] = src[node.args[1]]
                return
        self.add_node(node, Op.of(target), node.args, node.kwargs)

    def on_call_method(self, node: torch.fx.Node) -> None:
        self.add_node(
            node,
            Op(OpKind.PYTHON, _MethodCall(node.target), f"method.{node.target}"),
            node.args,
            node.kwargs,
        )

    def on_call_module(self, node: torch.fx.Node) -> None:
        mod = self.gm.get_submodule(node.target)
        self.add_node(node, Op(OpKind.PYTHON, mod, f"module.{node.target}"), node.args, node.kwargs)

    def add_node(self, node: torch.fx.Node, op: Op, args: Any, kwargs: Any) -> None:
        args, kwargs = self.arg(tuple(args)), self.arg(dict(kwargs))
        ex = _example(node)
        n = _sequence_length(node)
        if n is None:
            outputs = [self.value_for(node.name, ex, node)]
            self.env[node] = Ref(outputs[0])
        else:
            items = ex if isinstance(ex, (list, tuple)) and len(ex) == n else [None] * n
            getitems = {u.args[1]: u for u in node.users if u.target is operator.getitem}
            outputs = [
                self.value_for(f"{node.name}_{i}", x, getitems.get(i)) for i, x in enumerate(items)
            ]
            self.env[node] = [Ref(v) for v in outputs]
        self.graph.nodes.append(
            Node(
                node.name,
                op,
                args,
                kwargs,
                outputs,
                multi=n is not None,
                stack_trace=node.meta.get("stack_trace"),
                copies=_copied_instead_of_aliasing(node, op),
            )
        )

    def on_output(self, node: torch.fx.Node) -> None:
        out = self.arg(node.args[0])
        self.graph.output = out


class _MethodCall:
    """``call_method`` target: calls ``args[0].<name>(*args[1:], **kwargs)``."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(obj, self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"method.{self.name}"


def from_fx(gm: torch.fx.GraphModule, example_inputs: Sequence[Any] | None = None) -> Graph:
    """Convert ``gm`` to an fxrt :class:`Graph`.

    Args:
        gm: an FX GraphModule, normally at ATen level (as AOTAutograd or ``torch.export`` give it).
        example_inputs: optional example (or fake) inputs, used for metadata when the
            placeholders carry none.

    Returns:
        The converted graph. Run :func:`fxrt.ir.verify` on it to check its invariants.
    """
    if not isinstance(gm, torch.fx.GraphModule):
        raise ConversionError(f"expected a torch.fx.GraphModule, got {type(gm).__name__}")
    return _Converter(gm, example_inputs).run()
