"""Lowering: ``(Graph, Plan, ArenaPlan) -> Program``, the flat form both loops execute.

A Program is a tuple of instructions over a register file indexed by value id. :func:`lower`
decides everything once, and each instruction says what it is: CALL, OUT, ALLOC, VIEW, SYM,
KERNEL, PYCALL, FREE, STREAM, RECORD or WAIT (:mod:`fxrt.exec.instructions`, which lists the kinds,
what each means, and every place a kind must be known).

STREAM, RECORD and WAIT come from the stream ops (:mod:`fxrt.ops.streams`, ordered by
:mod:`fxrt.passes.synchronize_streams`); :attr:`Program.streams` then says how many streams and
events there are and on which device (:mod:`fxrt.exec.streams`). Program order is a valid
schedule of a multi-stream program: the Python loop runs it so; the compiled loop runs each side
stream on a worker thread (CPU) or on a device stream. The per-call guards
(:mod:`fxrt.exec.guards`) are in :attr:`Program.guards`.

If the compiled loop cannot bind an instruction (an op the dispatcher lacks, arguments its schema
does not take), it demotes it (OUT/ALLOC/VIEW to CALL, CALL and KERNEL to PYCALL) and writes the
demotion back: its ``program`` is this Program with those instructions replaced, listed in
:attr:`Program.demotions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..ir.graph import Graph, Op, OpKind, Ref, refs_in
from ..ir.printer import format_arg, format_call
from ..ops.c_kernels import INT, CKernel
from .arena import ArenaPlan
from .elementwise import elementwise_form
from .guards import CallGuards
from .inputs import InputSpec, input_specs
from .instructions import (
    SYM_OPS,
    Alloc,
    Call,
    Free,
    Instr,
    Kernel,
    NodeInfo,
    OutCall,
    PyCall,
    Record,
    Step,
    Stream,
    SymStep,
    View,
    Wait,
)
from .plan import Plan
from .streams import StreamStep, StreamTable, stream_table

_SYM_ARITY = {"neg": 1}


@dataclass(frozen=True)
class Demotion:
    """An instruction the compiled loop could not run as lowered, and what it runs instead."""

    pc: int
    node: str
    was: str  # the kind lowered
    now: str  # the kind run
    reason: str


@dataclass(frozen=True)
class Program:
    code: tuple[Instr, ...]
    n_regs: int
    inputs: tuple[int, ...]  # register of each graph input, in call order
    constants: tuple[tuple[int, Any], ...]  # (register, object) preloaded before each call
    output: Any  # the result's nesting, of Ref and constants
    nodes: tuple[NodeInfo, ...]
    reg_names: tuple[str, ...]
    peak_bytes: int
    arena: ArenaPlan | None = None
    guards: CallGuards = CallGuards()
    demotions: tuple[Demotion, ...] = ()
    streams: StreamTable | None = None  # a multi-stream program's streams and events

    @property
    def input_specs(self) -> tuple[InputSpec, ...]:
        """What each call checks about its inputs (fxrt.exec.inputs)."""
        return self.guards.input_specs

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """Names of the nodes that run as Python fallbacks (PYCALL)."""
        return tuple(self.nodes[i.node].name for i in self.code if isinstance(i, PyCall))

    def __str__(self) -> str:
        return program_to_text(self)


def lower(
    graph: Graph,
    plan: Plan,
    arena: ArenaPlan | None = None,
    views: frozenset[int] = frozenset(),
    *,
    check_inputs: bool = True,
    elementwise: bool = True,
) -> Program:
    """Emit the instruction tuple for ``graph``: the kind of each node's instruction, the FREEs
    ``plan`` places, the arena slots ``arena`` assigns, the views (node indices) made inline on
    calls with an arena, the OUTs with an inline elementwise form (with ``elementwise``:
    :mod:`fxrt.exec.elementwise`), and the per-call guards."""
    code: list[Instr] = []
    infos: list[NodeInfo] = []
    slot_of = arena.slot_of() if arena is not None else {}
    streams = stream_table(graph)
    steps = streams[1] if streams is not None else {}
    for i, node in enumerate(graph.nodes):
        infos.append(NodeInfo(node.name, node.op.name, node.stack_trace))
        if i in steps:
            code.append(_stream_instruction(node, i, steps[i]))
        else:
            code.append(_instruction(graph, arena, slot_of, i, i in views, elementwise))
        if plan.frees[i]:
            code.append(Free(plan.frees[i]))
    constants = tuple(graph.constants.items())
    guards = CallGuards(
        input_specs=input_specs(graph) if check_inputs else (),
        arena_inputs=arena.input_guards if arena is not None else (),
        constants_need_grad=any(
            isinstance(c, torch.Tensor) and c.requires_grad for _, c in constants
        ),
    )
    return Program(
        code=tuple(code),
        n_regs=len(graph.values),
        inputs=tuple(graph.inputs),
        constants=constants,
        output=graph.output,
        nodes=tuple(infos),
        reg_names=tuple(v.name for v in graph.values),
        peak_bytes=plan.peak_bytes,
        arena=arena,
        guards=guards,
        streams=streams[0] if streams is not None else None,
    )


def _stream_instruction(node: Any, i: int, step: StreamStep) -> Stream:
    args = (i, node.op.target, node.args, dict(node.kwargs), tuple(node.outputs), node.multi)
    if step.kind == "RECORD":
        return Record(*args, step.stream, event=step.events[0])
    if step.kind == "WAIT":
        return Wait(*args, step.stream, events=step.events, protect=step.protect)
    return Stream(*args, step.stream)


def _instruction(
    graph: Graph,
    arena: ArenaPlan | None,
    slot_of: dict[int, int],
    i: int,
    inline_view: bool,
    elementwise: bool,
) -> Instr:
    node = graph.nodes[i]
    args = (i, node.op.target, node.args, dict(node.kwargs), tuple(node.outputs), node.multi)
    if node.op.kind is not OpKind.ATEN:
        op = SYM_OPS.get(node.op.target)
        if op is not None and _sym_args(op, node.args) and not node.kwargs and not node.multi:
            return SymStep(i, node.op.target, node.args, {}, tuple(node.outputs), op=op)
        if _native_kernel(node):
            return Kernel(i, node.op.target, node.args, {}, tuple(node.outputs))
        return PyCall(*args)
    slot = slot_of.get(node.outputs[0], -1)
    name = node.op.name
    if slot >= 0:  # plan_arena decided how the node writes its slot (arena_call)
        s = arena.slots[slot]
        if s.out_target is None:
            return Alloc(*args, slot=slot, cpu=_cpu_empty_strided(name, node.args, node.kwargs))
        return OutCall(
            *args,
            slot=slot,
            out_target=s.out_target,
            out_args=s.out_args,
            out_kwargs=s.out_kwargs,
            elementwise=elementwise_form(graph, s) if elementwise else "",
        )
    if name == "aten::empty_strided" and _cpu_empty_strided(name, node.args, node.kwargs):
        return Alloc(*args, cpu=True)
    view = _view_form(name, node.args, node.kwargs, node.multi)
    if view is not None and (inline_view or view[0] == "reinterpret"):
        kind, ints, strides, offset = view
        always = kind == "reinterpret"
        return View(*args, view=kind, ints=ints, strides=strides, offset=offset, always=always)
    return Call(*args)


def _native_kernel(node: Any) -> bool:
    """A call of a C kernel the compiled loop can call: an argument per parameter, each a
    register or (for an integer parameter) an int."""
    k = node.op.target
    if not isinstance(k, CKernel) or not k.address or node.kwargs or node.multi:
        return False
    if len(node.args) != len(k.params):
        return False
    return all(
        isinstance(a, Ref) or (p == INT and type(a) is int) for a, p in zip(node.args, k.params)
    )


def _is_ints(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(type(v) is int for v in x)


def _sym_args(op: str, args: tuple[Any, ...]) -> bool:
    if len(args) != _SYM_ARITY.get(op, 2):
        return False
    return all(isinstance(a, Ref) or type(a) is int for a in args)


def _cpu_empty_strided(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``aten::empty_strided`` with constant arguments for the CPU: made without the dispatcher,
    exactly as its CPU kernel makes it (about 1 us less per allocation)."""
    if name != "aten::empty_strided" or refs_in((args, kwargs)) or len(args) != 2:
        return False
    sizes, strides = args
    if not (_is_ints(sizes) and _is_ints(strides)) or len(sizes) != len(strides):
        return False
    if any(v < 0 for v in (*sizes, *strides)):
        return False  # the dispatcher raises the op's own error
    if set(kwargs) - {"dtype", "layout", "device", "pin_memory"}:
        return False
    device = kwargs.get("device")
    layout = kwargs.get("layout")
    return (
        (device is None or torch.device(device).type == "cpu")
        and layout in (None, torch.strided)
        and not kwargs.get("pin_memory")
    )


def _view_form(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], multi: bool
) -> tuple[str, tuple[int, ...], tuple[int, ...], int] | None:
    """``(view kind, ints, strides, offset)`` for a view op with constant arguments besides its
    input, or None."""
    if kwargs or not args or not isinstance(args[0], Ref):
        return None
    rest = args[1:]
    if name == "aten::split.Tensor":
        if multi and 1 <= len(rest) <= 2 and all(type(d) is int for d in rest) and rest[0] > 0:
            return "split", (rest[0], rest[1] if len(rest) == 2 else 0), (), 0
        return None
    if multi:
        return None
    if name in ("aten::view", "aten::_unsafe_view") and len(rest) == 1 and _is_ints(rest[0]):
        return "view", tuple(rest[0]), (), 0
    if name == "aten::permute" and len(rest) == 1 and _is_ints(rest[0]):
        return "permute", tuple(rest[0]), (), 0
    if name == "aten::t" and not rest:
        return "t", (), (), 0
    if name == "aten::transpose.int" and len(rest) == 2 and all(type(d) is int for d in rest):
        return "transpose", tuple(rest), (), 0
    if (
        name == "fxrt::reinterpret_tensor"
        and len(rest) == 3
        and _is_ints(rest[0])
        and _is_ints(rest[1])
        and type(rest[2]) is int
    ):
        return "reinterpret", tuple(rest[0]), tuple(rest[1]), rest[2]
    return None


def program_to_text(program: Program) -> str:
    """The listing: one numbered line per instruction with its kind, FREEs included, then the
    fallbacks and demotions. An OUT ends with ``-> arena[start:end] via <out= call>``, an ALLOC
    with ``-> arena[start:end]`` and/or ``(cpu)``, a VIEW with ``(inline)`` (every call) or
    ``(inline with arena)``, a demoted PYCALL with its reason."""
    names = dict(enumerate(program.reg_names))
    lines = [
        "program("
        + ", ".join(f"%{names[r]}" for r in program.inputs)
        + f"): {program.n_regs} registers"
    ]
    for r, c in program.constants:
        lines.append(f"  const  %{names[r]} = {format_arg(c)}")
    if program.arena is not None:
        lines.append(f"  arena  {program.arena.nbytes} bytes, {len(program.arena.slots)} slots")
    if program.streams is not None:
        lines.append(f"  {program.streams.text()}")
    for pc, ins in enumerate(program.code):
        if isinstance(ins, Free):
            text = "FREE   " + ", ".join(f"%{names[r]}" for r in ins.regs)
        elif isinstance(ins, Stream):
            text = _stream_text(program, ins, names)
        else:
            outs = ", ".join(f"%{names[r]}" for r in ins.outputs)
            if ins.multi:
                outs = f"({outs})"
            text = (
                f"{ins.KIND:<7}{outs} = "
                + format_call(program.nodes[ins.node].op, ins.args, ins.kwargs, names)
                + _suffix(program, ins, names)
            )
        lines.append(f"  {pc:>4}  {text}")
    lines.append(f"  return {format_arg(program.output, names)}")
    if program.fallbacks:
        lines.append("fallbacks: " + ", ".join(program.fallbacks))
    for d in program.demotions:
        lines.append(f"demoted: {d.pc} {d.node} {d.was} -> {d.now} ({d.reason})")
    return "\n".join(lines)


def _stream_text(program: Program, ins: Stream, names: dict[int, str]) -> str:
    if isinstance(ins, Record):
        return f"RECORD event {ins.event} on stream {ins.stream}  # {program.nodes[ins.node].name}"
    if isinstance(ins, Wait):
        evs = ", ".join(map(str, ins.events))
        text = f"WAIT   events {evs} on stream {ins.stream}"
        if ins.protect:
            text += " protect " + ", ".join(f"%{names[r]}" for r in ins.protect)
        return text
    label = program.streams.labels[ins.stream] if program.streams is not None else None
    return f"STREAM {ins.stream} ({'caller' if label is None else repr(label)})"


def _suffix(program: Program, ins: Instr, names: dict[int, str]) -> str:
    if isinstance(ins, Call) and ins.slot >= 0:
        slots = program.arena.slots[ins.slot : ins.slot + len(ins.outputs)]
        text = " -> " + ", ".join(f"arena[{s.offset}:{s.offset + s.nbytes}]" for s in slots)
        if isinstance(ins, OutCall):
            out_name = Op.of(ins.out_target).name
            inline = f" (inline {ins.elementwise})" if ins.elementwise else ""
            if ins.out_args == ins.args:  # the same arguments, then out=
                return text + f" via {out_name}" + inline
            via = format_call(out_name, ins.out_args, ins.out_kwargs, names)
            return text + " via " + via + inline
        return text + (" (cpu)" if isinstance(ins, Alloc) and ins.cpu else "")
    if isinstance(ins, Alloc) and ins.cpu:
        return " (cpu)"
    if isinstance(ins, View):
        return " (inline, any call)" if ins.always else " (inline)"
    if isinstance(ins, PyCall) and ins.reason:
        return f"  # {ins.reason}"
    return ""


def input_refs(ins: Instr) -> list[int]:
    """Register ids an instruction reads (none for a FREE or a stream instruction)."""
    if isinstance(ins, (Free, Stream)):
        return []
    return refs_in((ins.args, ins.kwargs))


__all__ = [
    "SYM_OPS",
    "Alloc",
    "Call",
    "Demotion",
    "Free",
    "Instr",
    "Kernel",
    "NodeInfo",
    "OutCall",
    "Program",
    "PyCall",
    "Record",
    "Ref",
    "Step",
    "Stream",
    "SymStep",
    "View",
    "Wait",
    "input_refs",
    "lower",
    "program_to_text",
]
