"""Lowering: ``(Graph, Plan) -> Program``, the flat form both loops execute.

A Program is a tuple of instructions over a register file indexed by value id:

* ``Call``: an ATen op, run natively by the compiled loop (boxed dispatch);
* ``PyCall``: a fallback that calls a Python callable (higher-order ops, SymInt arithmetic,
  Python functions) inside the same loop;
* ``Free``: release registers after their alias set's last use.

A ``Call`` whose result has a slot in the Program's arena (:mod:`fxrt.exec.arena`) carries the
slot and the ``out=`` overload that writes there (None for an allocation, which needs no call);
a loop uses them when it runs the call with an arena, and the plain call otherwise.

Everything the loop needs is resolved here, once: the op, constant arguments (kept in place), and
register references (:class:`~fxrt.ir.Ref`). Constants the graph owns are preloaded registers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from ..ir.graph import Graph, Op, OpKind, Ref, refs_in
from ..ir.printer import format_arg, format_call
from .arena import ArenaPlan, arena_call
from .inputs import InputSpec, input_specs
from .plan import Plan


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What an error message says about the node an instruction came from."""

    name: str
    op: str
    stack_trace: str | None


@dataclass(frozen=True, slots=True)
class Call:
    node: int  # index into Program.nodes
    target: Any  # torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[int, ...]
    multi: bool  # the op returns a sequence unpacked into ``outputs``
    # With an arena: the result's slot (-1: none), and the call that writes the slot, its
    # kwargs passing ``out`` as the result's own register, which holds the slot's tensor by then
    # (``out_target`` None: an allocation, the slot itself is the result).
    slot: int = -1
    out_target: Any = None
    out_args: tuple[Any, ...] = ()
    out_kwargs: dict[str, Any] | None = None
    inline_view: bool = False  # a view the compiled loop may make inline on those calls


@dataclass(frozen=True, slots=True)
class PyCall:
    node: int
    target: Any  # any Python callable
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[int, ...]
    multi: bool


@dataclass(frozen=True, slots=True)
class Free:
    regs: tuple[int, ...]


Instr = Union[Call, PyCall, Free]


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
    input_specs: tuple[InputSpec, ...] = ()  # what each call checks (fxrt.exec.inputs)

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """Names of the nodes that run as Python fallbacks."""
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
    """Emit the instruction tuple for ``graph``, with the FREEs ``plan`` places, the arena
    slots ``arena`` assigns and the inline ``views`` (node indices) marked."""
    code: list[Instr] = []
    infos: list[NodeInfo] = []
    slot_of = arena.slot_of() if arena is not None else {}
    for i, node in enumerate(graph.nodes):
        infos.append(NodeInfo(node.name, node.op.name, node.stack_trace))
        args = (i, node.op.target, node.args, dict(node.kwargs), tuple(node.outputs), node.multi)
        if node.op.kind is not OpKind.ATEN:
            code.append(PyCall(*args))
        elif node.outputs[0] in slot_of:
            code.append(Call(*args, slot_of[node.outputs[0]], *arena_call(graph, node)))
        else:
            code.append(Call(*args, inline_view=i in views))
        if plan.frees[i]:
            code.append(Free(plan.frees[i]))
    return Program(
        code=tuple(code),
        n_regs=len(graph.values),
        inputs=tuple(graph.inputs),
        constants=tuple(graph.constants.items()),
        output=graph.output,
        nodes=tuple(infos),
        reg_names=tuple(v.name for v in graph.values),
        peak_bytes=plan.peak_bytes,
        arena=arena,
        input_specs=input_specs(graph) if check_inputs else (),
    )


def program_to_text(program: Program) -> str:
    """The listing: one numbered line per instruction, FREEs included, then the fallbacks.
    A call whose result lives in the arena ends with ``-> arena[start:end] via <out= call>``, or
    ``(no call)`` for an allocation, which takes the slot as it is; an inline view ends with
    ``(inline)``."""
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
    for pc, ins in enumerate(program.code):
        if isinstance(ins, Free):
            text = "FREE   " + ", ".join(f"%{names[r]}" for r in ins.regs)
        else:
            outs = ", ".join(f"%{names[r]}" for r in ins.outputs)
            if ins.multi:
                outs = f"({outs})"
            opcode = "CALL   " if isinstance(ins, Call) else "PYCALL "
            text = (
                opcode
                + f"{outs} = "
                + format_call(program.nodes[ins.node].op, ins.args, ins.kwargs, names)
            )
            if isinstance(ins, Call) and ins.slot >= 0:
                slot = program.arena.slots[ins.slot]
                text += f" -> arena[{slot.offset}:{slot.offset + slot.nbytes}]"
                out_name = ins.out_target is not None and Op.of(ins.out_target).name
                if ins.out_target is None:
                    text += " (no call)"
                elif ins.out_args == ins.args:  # the same arguments, then out=
                    text += f" via {out_name}"
                else:
                    text += " via " + format_call(out_name, ins.out_args, ins.out_kwargs, names)
            elif isinstance(ins, Call) and ins.inline_view:
                text += " (inline)"
        lines.append(f"  {pc:>4}  {text}")
    lines.append(f"  return {format_arg(program.output, names)}")
    if program.fallbacks:
        lines.append("fallbacks: " + ", ".join(program.fallbacks))
    return "\n".join(lines)


def input_refs(ins: Call | PyCall) -> list[int]:
    return refs_in((ins.args, ins.kwargs))


__all__ = [
    "Call",
    "Free",
    "Instr",
    "NodeInfo",
    "Program",
    "PyCall",
    "Ref",
    "input_refs",
    "lower",
    "program_to_text",
]
