"""The instruction kinds of a Program, and every place a kind must be known.

=======  ===========================================================================================
CALL     :class:`Call`: an ATen op through the dispatcher (boxed, every schema argument bound).
OUT      :class:`OutCall`: on calls with an arena, the result is arena slot ``slot`` (a node's
         several results: the slots from ``slot`` on, one per output) and the op's ``out=`` form
         writes it; on calls without one, the plain call. (Should an ``out=`` kernel refuse the
         slot, the plain call runs and raises its own error, if any.)
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

Every kind but FREE is a :class:`Step`: it carries its plain form (``target(*args, **kwargs)``
into ``outputs``, the six fields in the base), which is what a call runs when
``__torch_function__`` must see its ops and what errors name.

:data:`KINDS` is the one list of kinds, in the compiled loop's order (``Instr::Kind`` in
``fxrt/_speedups/code.h``). A kind is known in these places, and ``tests/test_kinds.py`` fails when
one of them lacks a kind of :data:`KINDS`:

=====================================  ========================================================
``fxrt/exec/program.py``               :func:`~fxrt.exec.program.lower` makes it;
                                       ``program_to_text`` lists it (the kind's name)
``fxrt/exec/interp.py``                the Python loop: FREE and the stream kinds have cases of
                                       their own, every other kind runs its plain form
``fxrt/exec/native.py``                ``_BIND[kind]`` binds it to the compiled loop
``fxrt/_speedups/_loop.pyx``,          ``add_<kind>`` on the executor
``py_executor.h``
``fxrt/_speedups/code.h``,             ``Instr::Kind`` (code.h) and its ``case`` in the loop
``loop.h``
``fxrt/deploy/program_data.py``        the package encoding (``kind`` in each instruction)
``csrc/src/program.cpp``               the C++ runtime's loader (it runs or refuses it by name)
=====================================  ========================================================
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import torch


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What an error message says about the node an instruction came from."""

    name: str
    op: str
    stack_trace: str | None


@dataclass(frozen=True, slots=True)
class Step:
    """What every kind but FREE has: its plain form, ``target(*args, **kwargs)`` into
    ``outputs`` (what runs when ``__torch_function__`` must see the ops, what the Python loop
    runs for most kinds, and what errors name)."""

    KIND: ClassVar[str] = ""
    node: int  # index into Program.nodes
    target: Any  # an OpOverload (CALL, OUT, ALLOC, VIEW), a CKernel, a Python callable, a scope op
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: tuple[int, ...]
    multi: bool = False  # the target returns a sequence unpacked into ``outputs``


@dataclass(frozen=True, slots=True)
class Call(Step):
    """CALL: ``target(*args, **kwargs)`` through the dispatcher, into ``outputs``."""

    KIND: ClassVar[str] = "CALL"
    slot: int = -1  # the result's arena slot (OUT, ALLOC), -1 for none

    def plain(self) -> Call:
        """The same call as a plain CALL (what a demotion turns it into)."""
        return Call(self.node, self.target, self.args, self.kwargs, self.outputs, self.multi)


@dataclass(frozen=True, slots=True)
class OutCall(Call):
    """OUT: with an arena, ``out_target(*out_args, **out_kwargs)`` writes slot ``slot`` (with
    ``multi``, output ``k`` is slot ``slot + k``); its written kwargs (``out``, or one per result)
    read the result registers, which hold the slots' tensors by then. With
    ``elementwise``, the compiled loop writes it with a loop of its own when the tensors allow."""

    KIND: ClassVar[str] = "OUT"
    out_target: Any = None
    out_args: tuple[Any, ...] = ()
    out_kwargs: dict[str, Any] = field(default_factory=dict)
    # The compiled loop's inline form of the out= call (fxrt.exec.elementwise), "" for none.
    elementwise: str = ""


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
class SymStep(Step):
    """SYM: ``outputs[0] = target(*args)`` (``kwargs`` empty), scalar arithmetic named ``op``
    (:data:`SYM_OPS`)."""

    KIND: ClassVar[str] = "SYM"
    op: str = ""


@dataclass(frozen=True, slots=True)
class PyCall(Step):
    """PYCALL: a Python callable called inside the loop."""

    KIND: ClassVar[str] = "PYCALL"
    reason: str = ""  # why a CALL became one (a demotion), empty for the graph's own fallbacks


@dataclass(frozen=True, slots=True)
class Kernel(Step):
    """KERNEL: ``target`` (a :class:`~fxrt.ops.c_kernels.CKernel` with an address) called on its
    arguments: registers (a tensor per pointer parameter, an int per integer one) and ints;
    ``kwargs`` empty, ``outputs`` the node's None."""

    KIND: ClassVar[str] = "KERNEL"


@dataclass(frozen=True, slots=True)
class Free:
    """FREE: release registers after their alias set's last use."""

    KIND: ClassVar[str] = "FREE"
    regs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Stream(Step):
    """STREAM: what follows runs on stream ``stream`` (0: the caller's)."""

    KIND: ClassVar[str] = "STREAM"
    stream: int = 0


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


Instr = Union[Step, Free]

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


# Every kind, in the order of ``Instr::Kind`` (fxrt/_speedups/code.h).
KINDS: tuple[type, ...] = (
    Call,
    OutCall,
    Alloc,
    View,
    SymStep,
    Kernel,
    PyCall,
    Free,
    Stream,
    Record,
    Wait,
)
KIND_NAMES: tuple[str, ...] = tuple(k.KIND for k in KINDS)

__all__ = [
    "KINDS",
    "KIND_NAMES",
    "SYM_OPS",
    "Alloc",
    "Call",
    "Free",
    "Instr",
    "Kernel",
    "NodeInfo",
    "OutCall",
    "PyCall",
    "Record",
    "Step",
    "Stream",
    "SymStep",
    "View",
    "Wait",
]
