"""Lowering: ``(Graph, Plan, ArenaPlan) -> Program``, the flat form both loops execute.

A Program is a tuple of instructions over a register file indexed by value id. :func:`lower`
decides everything once, and each instruction says what it is:

=======  ===========================================================================================
CALL     :class:`Call`: an ATen op through the dispatcher (boxed, every schema argument bound).
OUT      :class:`OutCall`: on calls with an arena, the result is arena slot ``slot`` and the op's
         ``out=`` form writes it; on calls without one, the plain call. (Should an ``out=`` kernel
         refuse the slot, the plain call runs and raises its own error, if any.)
ALLOC    :class:`Alloc`: uninitialized memory. On calls with an arena, slot ``slot`` is the result
         (no call). Otherwise, when ``cpu``: a constant CPU ``empty_strided`` made directly, as
         its CPU kernel makes it; else the plain call.
VIEW     :class:`View`: a view made inline (a new TensorImpl on the input's storage, geometry from
         the constant arguments and the actual input), on every call (``reinterpret``, which
         tracks no view even in eager's Inductor wrapper) or on calls with an arena (no autograd
         to record it: :mod:`fxrt.exec.views`). The plain call when the input is not a plain
         strided tensor or the view does not apply.
SYM      :class:`SymStep`: scalar arithmetic on sizes (``operator.mul`` of a SymInt and an int),
         computed natively on integers, in Python only for other operands.
KERNEL   :class:`Kernel`: a compiled C function (:class:`fxrt.ops.c_kernels.CKernel`: one of
         Inductor's C++ kernels), called by the compiled loop with its tensors' data pointers
         and its integers; its Python binding in the Python loop.
PYCALL   :class:`PyCall`: a Python callable (higher-order ops, Python functions), called inside
         the same loop; ``reason`` says why it is one when the compiled loop demoted a CALL.
FREE     :class:`Free`: release registers after their alias set's last use.
STREAM   :class:`Stream`: the instructions that follow run on stream ``stream`` (a scope op).
RECORD   :class:`Record`: event ``event`` marks how far the current stream has come.
WAIT     :class:`Wait`: the current stream waits until each of ``events`` was reached.
=======  ===========================================================================================

STREAM, RECORD and WAIT come from the stream ops (:mod:`fxrt.ops.streams`, ordered by
:mod:`fxrt.passes.streams`); :attr:`Program.streams` then says how many streams and events there
are and on which device (:mod:`fxrt.exec.streams`). Program order is a valid schedule of a
multi-stream program: the Python loop runs it so; the compiled loop runs each side stream on a
worker thread (CPU) or on a device stream.

Every kind but FREE carries the plain form (``target(*args, **kwargs)`` into ``outputs``), which
is what a call runs when ``__torch_function__`` must see its ops and what errors name. The
per-call guards (:mod:`fxrt.exec.guards`) are in :attr:`Program.guards`. Adding a kind means: its
class and its line in :func:`lower` and :func:`program_to_text` here, its case in the Python loop
(:mod:`fxrt.exec.interp`) and in the compiled loop (``fxrt/exec/native.py`` binds it,
``fxrt/_speedups/loop.h`` runs it).

If the compiled loop cannot bind an instruction (an op the dispatcher lacks, arguments its schema
does not take), it demotes it (OUT/ALLOC/VIEW to CALL, CALL and KERNEL to PYCALL) and writes the
demotion back: its ``program`` is this Program with those instructions replaced, listed in
:attr:`Program.demotions`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import torch

from ..ir.graph import Graph, Op, OpKind, Ref, refs_in
from ..ir.printer import format_arg, format_call
from ..ops.c_kernels import INT, CKernel
from .arena import ArenaPlan
from .guards import CallGuards
from .inputs import InputSpec, input_specs
from .plan import Plan
from .streams import StreamStep, StreamTable, stream_table


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What an error message says about the node an instruction came from."""

    name: str
    op: str
    stack_trace: str | None


@dataclass(frozen=True, slots=True)
class Call:
    """CALL: ``target(*args, **kwargs)`` through the dispatcher, into ``outputs``."""

    KIND: ClassVar[str] = "CALL"
    node: int  # index into Program.nodes
    target: Any  # torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[int, ...]
    multi: bool  # the op returns a sequence unpacked into ``outputs``
    slot: int = -1  # the result's arena slot (OUT, ALLOC), -1 for none

    def plain(self) -> Call:
        """The same call as a plain CALL (what a demotion turns it into)."""
        return Call(self.node, self.target, self.args, self.kwargs, self.outputs, self.multi)


@dataclass(frozen=True, slots=True)
class OutCall(Call):
    """OUT: with an arena, ``out_target(*out_args, **out_kwargs)`` writes slot ``slot``; its
    ``out`` kwarg reads the result register, which holds the slot's tensor by then."""

    KIND: ClassVar[str] = "OUT"
    out_target: Any = None
    out_args: tuple[Any, ...] = ()
    out_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Alloc(Call):
    """ALLOC: the arena slot (``slot`` >= 0, calls with an arena), else a direct CPU
    ``empty_strided`` (``cpu``), else the plain call."""

    KIND: ClassVar[str] = "ALLOC"
    cpu: bool = False


@dataclass(frozen=True, slots=True)
class View(Call):
    """VIEW: ``view`` is ``view`` (``ints``: the sizes), ``permute`` (``ints``: the dims),
    ``t``, ``transpose`` (``ints``: the two dims), ``split`` (``ints``: the split size and the
    dim; one output per piece) or ``reinterpret`` (``ints``: sizes, ``strides``, ``offset``:
    added to the input's). ``always``: on every call, else only on calls
    with an arena."""

    KIND: ClassVar[str] = "VIEW"
    view: str = ""
    ints: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    offset: int = 0
    always: bool = False


@dataclass(frozen=True, slots=True)
class SymStep:
    """SYM: ``outputs[0] = target(*args)``, scalar arithmetic named ``op`` (:data:`SYM_OPS`)."""

    KIND: ClassVar[str] = "SYM"
    node: int
    target: Any  # the Python callable (operator.mul...)
    op: str
    args: tuple[Any, ...]
    outputs: tuple[int, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)  # always empty
    multi: bool = False


@dataclass(frozen=True, slots=True)
class PyCall:
    """PYCALL: a Python callable called inside the loop."""

    KIND: ClassVar[str] = "PYCALL"
    node: int
    target: Any  # any Python callable
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[int, ...]
    multi: bool
    reason: str = ""  # why a CALL became one (a demotion), empty for the graph's own fallbacks


@dataclass(frozen=True, slots=True)
class Kernel:
    """KERNEL: ``target`` (a :class:`~fxrt.ops.c_kernels.CKernel` with an address) called on its
    arguments: registers (a tensor per pointer parameter, an int per integer one) and ints."""

    KIND: ClassVar[str] = "KERNEL"
    node: int
    target: CKernel
    args: tuple[Any, ...]
    kwargs: dict[str, Any]  # always empty
    outputs: tuple[int, ...]  # the node's None
    multi: bool = False


@dataclass(frozen=True, slots=True)
class Free:
    KIND: ClassVar[str] = "FREE"
    regs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stream:
    """STREAM: what follows runs on stream ``stream`` (0: the caller's)."""

    KIND: ClassVar[str] = "STREAM"
    node: int
    target: Any  # the scope op
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[int, ...]
    multi: bool
    stream: int


@dataclass(frozen=True, slots=True)
class Record(Stream):
    """RECORD: event ``event`` on stream ``stream`` (the current one)."""

    KIND: ClassVar[str] = "RECORD"
    event: int = 0


@dataclass(frozen=True, slots=True)
class Wait(Stream):
    """WAIT: stream ``stream`` waits for ``events``; ``protect``: registers made on other
    streams that this stream reads after the wait (a device executor marks their memory as in
    use on this stream, as ``record_stream`` does)."""

    KIND: ClassVar[str] = "WAIT"
    events: tuple[int, ...] = ()
    protect: tuple[int, ...] = ()


Instr = Union[Call, SymStep, Kernel, PyCall, Free, Stream]

# SYM steps: Python callable -> the name both loops know. The compiled loop computes them on
# int64 (Python's semantics: floor division and modulo round toward negative infinity; overflow,
# division by zero and other operand types take the Python call).
SYM_OPS: dict[Any, str] = {
    operator.add: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.floordiv: "floordiv",
    operator.mod: "mod",
    operator.neg: "neg",
    operator.eq: "eq",
    operator.ne: "ne",
    operator.lt: "lt",
    operator.le: "le",
    operator.gt: "gt",
    operator.ge: "ge",
    torch.sym_max: "max",
    torch.sym_min: "min",
}
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
) -> Program:
    """Emit the instruction tuple for ``graph``: the kind of each node's instruction, the FREEs
    ``plan`` places, the arena slots ``arena`` assigns, the views (node indices) made inline on
    calls with an arena, and the per-call guards."""
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
            code.append(_instruction(graph, arena, slot_of, i, i in views))
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
    graph: Graph, arena: ArenaPlan | None, slot_of: dict[int, int], i: int, inline_view: bool
) -> Instr:
    node = graph.nodes[i]
    args = (i, node.op.target, node.args, dict(node.kwargs), tuple(node.outputs), node.multi)
    if node.op.kind is not OpKind.ATEN:
        op = SYM_OPS.get(node.op.target)
        if op is not None and _sym_args(op, node.args) and not node.kwargs and not node.multi:
            return SymStep(i, node.op.target, op, node.args, tuple(node.outputs))
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
            *args, slot=slot, out_target=s.out_target, out_args=s.out_args, out_kwargs=s.out_kwargs
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
        slot = program.arena.slots[ins.slot]
        text = f" -> arena[{slot.offset}:{slot.offset + slot.nbytes}]"
        if isinstance(ins, OutCall):
            out_name = Op.of(ins.out_target).name
            if ins.out_args == ins.args:  # the same arguments, then out=
                return text + f" via {out_name}"
            return text + " via " + format_call(out_name, ins.out_args, ins.out_kwargs, names)
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
    "Stream",
    "SymStep",
    "View",
    "Wait",
    "input_refs",
    "lower",
    "program_to_text",
]
