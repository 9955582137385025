"""What whole-graph capture (:mod:`fxrt.exec.capture`) can record, and the regions it splits a
graph into when some nodes cannot be recorded.

A node cannot be recorded into a device graph when running it needs the host to see device data
or host memory: an op that returns a number read from a tensor (``aten::_local_scalar_dense``,
``.item()``), an op whose result's shape depends on tensor data (``nonzero``; an output size that
is an unbacked symbol ``u0``), a node that reads or makes a CPU tensor, and a Python fallback
that reads a tensor. :func:`node_blockers` says which nodes, and why.

:func:`split_regions` cuts the graph's node list into maximal runs of recordable and
non-recordable nodes. Each run becomes a graph of its own (its inputs are the values it reads
that an earlier run, the graph's inputs or the caller define; its outputs are the values it
defines that a later run or the graph's result reads; the constants it reads are its own
constants). The nodes are the graph's own, unchanged, so running the regions in order is running
the graph; recordable regions are captured, the others run on the loop.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ir.graph import Graph, Node, OpKind, Ref, ValueKind, map_refs, refs_in, substitute_refs
from ..ops.streams import is_stream_op
from .capture_report import CaptureReport
from .inputs import check_inputs
from .program import Kernel, Program, PyCall

# Ops that read a tensor's metadata, not its data: the host may call them while capturing.
_METADATA_OPS = frozenset(
    "size stride dim numel storage_offset is_contiguous is_same_size is_floating_point "
    "is_complex element_size".split()
)
_HOST_TYPES = frozenset(("int", "float", "bool", "Scalar", "number", "complex"))
_UNBACKED = re.compile(r"\bu\d+\b")
# Ops whose result's shape depends on tensor data: the host must read it (a sync).
_DATA_DEPENDENT = frozenset(
    "nonzero argwhere masked_select unique _unique _unique2 unique_consecutive unique_dim "
    "bincount".split()
)


def _is_cpu_tensor(graph: Graph, vid: int) -> bool:
    v = graph.values[vid]
    if v.kind is not ValueKind.TENSOR:
        return False
    obj = graph.constants.get(vid)
    if isinstance(obj, torch.Tensor):
        return obj.device.type == "cpu"
    return v.meta is not None and v.meta.device == "cpu"


def node_blockers(graph: Graph, program: Program) -> dict[int, str]:
    """Node index -> why that node cannot be recorded into a device graph (a sentence naming
    it); nodes not in the result can be."""
    why: dict[int, str] = {}
    values = graph.values
    for i, node in enumerate(graph.nodes):
        reason = _blocker(graph, node)
        if reason:
            why[i] = f"node {node.name} ({node.op.name}) {reason}"
    for ins in program.code:
        if isinstance(ins, (PyCall, Kernel)) and ins.node not in why:
            tensors = [
                r
                for r in refs_in((ins.args, ins.kwargs))
                if r < len(values) and values[r].kind is ValueKind.TENSOR
            ]
            if tensors:
                info = program.nodes[ins.node]
                where = "in Python" if isinstance(ins, PyCall) else "a C kernel on the host"
                why[ins.node] = (
                    f"node {info.name} ({info.op}) runs {where} and reads tensor "
                    f"{values[tensors[0]].name}"
                )
    return why


def _blocker(graph: Graph, node: Node) -> str:
    values = graph.values
    if is_stream_op(node.op.name):  # recorded as the streams' own waits (fxrt.exec.streams)
        return ""
    if node.op.kind is OpKind.ATEN:
        schema = node.op.schema
        base = schema.name.split("::")[-1]
        reads_host = any(str(r.type) in _HOST_TYPES for r in schema.returns)
        if reads_host and base not in _METADATA_OPS and not base.startswith("sym_"):
            return "reads a device value on the host"
        if base in _DATA_DEPENDENT:
            return "has a data-dependent shape"
    for vid in node.input_ids():
        if _is_cpu_tensor(graph, vid):
            return f"reads a CPU tensor ({values[vid].name})"
    for vid in node.outputs:
        meta = values[vid].meta
        if meta is None:
            continue
        if any(_UNBACKED.search(str(s)) for s in meta.shape):
            return f"has a data-dependent shape ({values[vid].name}: {meta})"
        if meta.device == "cpu" and values[vid].kind is ValueKind.TENSOR:
            return f"makes a CPU tensor ({values[vid].name})"
    return ""


def mutated_inputs(graph: Graph) -> frozenset[int]:
    """Positions of the graph inputs some node writes (through a view or not)."""
    from ..ops.aliasing import alias_sets, bind_schema_args

    roots = alias_sets(graph).root
    written: set[int] = set()
    for node in graph.nodes:
        if node.op.kind is not OpKind.ATEN:
            written.update(roots[v] for v in node.input_ids())  # opaque Python: assume it writes
            continue
        schema = node.op.schema
        if not schema.is_mutable:
            continue
        bound = bind_schema_args(schema, node.args, node.kwargs)
        for a in schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write and a.name in bound:
                written.update(roots[v] for v in refs_in(bound[a.name]))
    return frozenset(i for i, vid in enumerate(graph.inputs) if roots[vid] in written)


@dataclass
class Region:
    """A run of consecutive nodes, as a graph of its own."""

    graph: Graph
    inputs: tuple[int, ...]  # the outer values it reads, in its input order
    outputs: tuple[int, ...]  # the outer values it defines that later regions or the result read
    capture: bool
    reason: str  # for a region that is not captured: its first node's blocker
    first: str  # its first and last node's names
    last: str


def split_regions(graph: Graph, blocked: dict[int, str]) -> list[Region]:
    """The graph's nodes as maximal runs that are all recordable or all not (see the module
    docstring)."""
    runs: list[list[int]] = []
    for i in range(len(graph.nodes)):
        if runs and (runs[-1][-1] in blocked) == (i in blocked):
            runs[-1].append(i)
        else:
            runs.append([i])
    defined_in: dict[int, int] = {}
    for r, run in enumerate(runs):
        for i in run:
            for vid in graph.nodes[i].outputs:
                defined_in[vid] = r
    read_later: dict[int, int] = {}  # value -> the last run that reads it (len(runs): the result)
    for r, run in enumerate(runs):
        for i in run:
            for vid in graph.nodes[i].input_ids():
                read_later[vid] = max(read_later.get(vid, -1), r)
    for vid in refs_in(graph.output):
        read_later[vid] = len(runs)
    regions = []
    for r, run in enumerate(runs):
        reads: list[int] = []
        for i in run:
            for vid in graph.nodes[i].input_ids():
                if defined_in.get(vid, -1) != r and vid not in reads:
                    reads.append(vid)
        outputs = tuple(
            vid for i in run for vid in graph.nodes[i].outputs if read_later.get(vid, -1) > r
        )
        inputs = tuple(v for v in reads if v not in graph.constants)
        constants = [v for v in reads if v in graph.constants]
        sub = _subgraph(graph, run, inputs, constants, outputs)
        nodes = graph.nodes
        regions.append(
            Region(
                sub,
                inputs,
                outputs,
                capture=run[0] not in blocked,
                reason=blocked.get(run[0], ""),
                first=nodes[run[0]].name,
                last=nodes[run[-1]].name,
            )
        )
    return regions


def _subgraph(
    graph: Graph,
    run: list[int],
    inputs: tuple[int, ...],
    constants: list[int],
    outputs: tuple[int, ...],
) -> Graph:
    sub = Graph()
    mapping: dict[int, int] = {}

    def copy_value(vid: int) -> int:
        v = graph.values[vid]
        mapping[vid] = sub.add_value(v.name, v.kind, v.meta, v.expr)
        return mapping[vid]

    for vid in inputs:
        sub.inputs.append(copy_value(vid))
    for vid in constants:
        sub.constants[copy_value(vid)] = graph.constants[vid]
    for i in run:
        node = graph.nodes[i]
        args = substitute_refs(node.args, mapping)
        kwargs = substitute_refs(node.kwargs, mapping)
        outs = [copy_value(vid) for vid in node.outputs]
        sub.nodes.append(
            Node(node.name, node.op, args, kwargs, outs, node.multi, node.stack_trace, node.copies)
        )
    sub.output = tuple(Ref(mapping[vid]) for vid in outputs)
    return sub


class RegionRunner:
    """Runs a graph as its regions (:func:`fxrt.exec.capturable.split_regions`) in order: each
    a compiled graph of its own, captured or on the loop. The values that pass between regions
    are dropped after the last region that reads them."""

    def __init__(
        self,
        graph: Graph,
        program: Program,
        regions: list[Region],
        make_region: Callable[[Graph, bool], Any],
    ):
        self.specs = program.guards.input_specs
        self.graph_inputs = tuple(graph.inputs)
        self.constants = dict(graph.constants)
        self.output = graph.output
        self.regions = regions
        last_read: dict[int, int] = {}
        for k, r in enumerate(regions):
            for vid in r.inputs:
                last_read[vid] = k
        kept = set(refs_in(graph.output))
        self.parts = []
        for k, r in enumerate(regions):
            drop = tuple(v for v in r.inputs if last_read[v] == k and v not in kept)
            self.parts.append((make_region(r.graph, r.capture), r.inputs, r.outputs, drop))

    def __call__(self, inputs: Sequence[Any]) -> Any:
        if self.specs:
            check_inputs(self.specs, inputs)
        env = dict(self.constants)
        env.update(zip(self.graph_inputs, inputs))
        for cg, ins, outs, drop in self.parts:
            env.update(zip(outs, cg([env[v] for v in ins])))
            for v in drop:
                del env[v]
        return map_refs(self.output, lambda ref: env[ref.id])

    def report(self) -> list[tuple[str, CaptureReport | str]]:
        found: list[tuple[str, CaptureReport | str]] = []
        for r, (cg, *_) in zip(self.regions, self.parts):
            nodes = r.first if r.first == r.last else f"{r.first} .. {r.last}"
            found.append((nodes, cg.capture_report() if r.capture else r.reason))
        return found

    def release(self) -> None:
        for cg, *_ in self.parts:
            cg.release_memory()


__all__ = ["Region", "RegionRunner", "mutated_inputs", "node_blockers", "split_regions"]
