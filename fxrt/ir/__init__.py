"""fxrt's IR: dataclasses for graphs, conversion from torch.fx, verification and printing."""

from .from_fx import ConversionError, from_fx, tensor_meta
from .graph import Graph, Node, Op, OpKind, Ref, TensorMeta, Value, ValueKind, map_refs, refs_in
from .printer import graph_to_text
from .verify import VerificationError, verify

__all__ = [
    "ConversionError",
    "Graph",
    "Node",
    "Op",
    "OpKind",
    "Ref",
    "TensorMeta",
    "Value",
    "ValueKind",
    "VerificationError",
    "from_fx",
    "graph_to_text",
    "map_refs",
    "refs_in",
    "tensor_meta",
    "verify",
]
