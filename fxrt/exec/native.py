"""The compiled loop: runs a Program in C++ (``fxrt._speedups._loop``, see its ``loop.h``).

:class:`NativeLoop` hands the Program to the extension's ``Executor`` instruction by instruction,
in program order, one ``add_*`` call per instruction kind (fxrt/exec/program.py), so an
instruction's index is the same in both loops. The extension binds each to a dispatcher op with
its full boxed argument list; an instruction it cannot bind (an op the dispatcher does not know,
a call that does not bind to its schema) is demoted, OUT/ALLOC/VIEW to CALL and CALL to PYCALL
(which runs exactly as in the Python loop, and fails the same way), and the demotion is written
back: :attr:`NativeLoop.program` is the Program the loop runs, with
:attr:`~fxrt.exec.program.Program.demotions` listing them.

Per call, the Program's guards (:mod:`fxrt.exec.guards`) decide in C++ whether the call runs each
instruction's Python form (``__torch_function__`` must see its ops) and whether it uses an arena.
Errors are built by :func:`fxrt.errors.instruction_error`, as in the Python loop.

Loading: the extension is tied to the torch it was compiled against. This module imports it once,
when it is imported itself, and :func:`extension_status` says whether it can be used and why not.
The first time fxrt would have picked the compiled loop but cannot, :func:`native_available`
warns (once per process) and fxrt uses the Python loop.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ..errors import instruction_error
from ..ir.graph import Op, Ref
from ..ops.c_kernels import INT, POINTER
from .inputs import InputError, InputSpec, check_inputs
from .program import (
    SYM_OPS,
    Call,
    Demotion,
    Free,
    Instr,
    Kernel,
    OutCall,
    Program,
    PyCall,
    View,
)

# Release the GIL around native instructions, as torch.ops does around every op. Measured on the
# 200-op chain (tests/test_native.py, run as a script): no cost on one thread (1.96 us/node either
# way), and faster when threads share a compiled graph (4 threads: 4.4 vs 5.7 us/node).
RELEASE_GIL = True


@dataclass(frozen=True)
class ExtensionStatus:
    """Whether the compiled loop can run, and why not."""

    module: ModuleType | None
    reason: str  # why it is (not) usable, for runtime_info() and the fallback warning
    path: str | None = None  # the extension's file, when it imported
    built_torch: str | None = None  # torch.__version__ it was compiled against
    # The C++ runtime's face (fxrt._speedups._runtime, built with the loop): fxrt.load's loader.
    runtime: ModuleType | None = None

    @property
    def usable(self) -> bool:
        return self.module is not None


def _load() -> ExtensionStatus:
    try:
        _loop = importlib.import_module("fxrt._speedups._loop")
    except ModuleNotFoundError as e:
        if e.name != "fxrt._speedups._loop":
            return ExtensionStatus(None, f"extension failed to import: {e}")
        return ExtensionStatus(
            None, "extension not built (install with `pip install --no-build-isolation -e .`)"
        )
    except Exception as e:  # a broken build, missing libraries, another torch's symbols
        return ExtensionStatus(None, f"extension failed to import: {type(e).__name__}: {e}")
    path = getattr(_loop, "__file__", None)
    built = getattr(_loop, "TORCH_VERSION", None)
    if built != torch.__version__:
        return ExtensionStatus(
            None,
            f"extension built for torch {built}, running torch {torch.__version__}; "
            "rebuild it with `pip install --no-build-isolation -e .`",
            path,
            built,
        )
    try:
        runtime = importlib.import_module("fxrt._speedups._runtime")
    except Exception:  # an older build without it: fxrt.load reads packages in Python
        runtime = None
    return ExtensionStatus(_loop, f"extension built for torch {built}", path, built, runtime)


_status = _load()  # once per process, at import
_warned = False
_warn_lock = threading.Lock()


def extension_status() -> ExtensionStatus:
    """Whether the extension imported and matches the running torch (determined at import)."""
    return _status


def native_available() -> bool:
    """True if the compiled loop can run. If it cannot, warns once per process that fxrt falls
    back to the Python loop; call it only where the compiled loop would otherwise be used."""
    global _warned
    status = extension_status()
    if not status.usable:
        with _warn_lock:
            warn, _warned = not _warned, True
        if warn:
            warnings.warn(
                f"fxrt: compiled loop unavailable ({status.reason}); using the pure-Python loop. "
                "Set FXRT_PURE_PYTHON=1 to choose it explicitly.",
                RuntimeWarning,
                stacklevel=3,
            )
    return status.usable


if _status.usable:
    _Executor: type = _status.module.Executor

    def set_instrumenting(on: bool) -> None:
        """Whether an fxrt.profile() block is open: the compiled loop's and the runtime's calls
        then take their instrumented (Python) paths."""
        _status.module.set_instrumenting(on)
        if _status.runtime is not None:
            _status.runtime.set_instrumenting(on)

    NativeReplayIndex: type | None = _status.module.ReplayIndex  # see fxrt.exec.replays
else:

    class _Executor:  # the base NativeLoop gets when there is no extension; it refuses to build
        pass

    def set_instrumenting(on: bool) -> None:
        """Without the extension there is no compiled loop to tell."""

    NativeReplayIndex = None


_VIEW_KINDS = {"view": 0, "t": 1, "transpose": 2, "permute": 3, "reinterpret": 4, "split": 5}
_KERNEL_PARAMS = {POINTER: 0, INT: 1}  # c_kernel.h's KernelArg kinds
_SYM_KINDS = {op: k for k, op in enumerate(dict.fromkeys(SYM_OPS.values()))}  # loop.h's order


class NativeLoop(_Executor):
    """Executes a :class:`Program` with the compiled loop; same contract as
    :class:`~fxrt.exec.interp.PythonLoop`: ``loop(inputs)`` takes the list (or tuple) of graph
    inputs and returns the graph's output.

    It subclasses the extension's ``Executor`` so that calling it goes straight to the C++ loop
    (measured: a Python ``__call__`` delegating to it costs ~0.3 us per call, 10% of a one-op
    graph's call).

    Args:
        program: the Program to run.
        release_gil: release the GIL while native ops run (default :data:`RELEASE_GIL`).
        arena_max_idle: arenas kept between calls, per inference mode.

    Attributes:
        program: ``program`` with the demotions this loop needed written back.

    Raises:
        RuntimeError: the extension is not usable (see :func:`extension_status`).
    """

    name = "cpp"

    def __init__(
        self, program: Program, *, release_gil: bool = RELEASE_GIL, arena_max_idle: int = 2
    ):
        status = extension_status()
        if not status.usable:
            raise RuntimeError(f"fxrt: compiled loop unavailable: {status.reason}")
        self.release_gil = release_gil
        self._init_executor(Ref, program.n_regs, release_gil)
        self.set_inputs(list(program.inputs))
        for reg, obj in program.constants:
            self.set_constant(reg, obj)
        code: list[Instr] = []
        demotions = list(program.demotions)
        for pc, ins in enumerate(program.code):
            why = self._add(ins)
            while why is not None:  # demote until it binds; a PYCALL always does
                lowered = ins
                ins = _demoted(ins, why)
                name = program.nodes[ins.node].name
                demotions.append(Demotion(pc, name, lowered.KIND, ins.KIND, why))
                why = self._add(ins)
            code.append(ins)
        if demotions != list(program.demotions):
            program = dataclasses.replace(program, code=tuple(code), demotions=tuple(demotions))
        self.program = program
        self.set_output(program.output)
        guards = program.guards
        self.set_guards(
            [
                (
                    spec.pos,
                    torch.empty(0, dtype=spec.meta.dtype, device="meta"),
                    spec.meta.device,
                    list(spec.sizes),
                    list(spec.strides),
                )
                for spec in guards.input_specs
            ],
            lambda inputs: _input_error(guards.input_specs, inputs),
            [
                (pos, torch.empty(shape, dtype=dtype, device="meta"))
                for pos, shape, dtype in guards.arena_inputs
            ],
            guards.constants_need_grad,
        )
        if program.streams is not None:
            st = program.streams
            self.set_streams(len(st.labels), st.device, st.n_events)
        if program.arena is not None:
            self.set_arena(program.arena.allocate, arena_max_idle, program.arena.device)
        self.arena_max_idle = arena_max_idle
        self.set_names(
            [program.nodes[i.node].name if not isinstance(i, Free) else "" for i in program.code]
        )
        self._node_of_pc = tuple(-1 if isinstance(i, Free) else i.node for i in program.code)

    def keep_inputs(self, positions: list[int]) -> None:
        """The static inputs (parameters, buffers) by position: the frames keep their tensors
        between calls (fxrt/_speedups/frames.h). The first call of this method decides; later
        ones change nothing."""
        if not getattr(self, "_kept", None) and positions:
            self._kept = tuple(positions)
            self.set_kept_inputs(list(positions))

    def _add(self, ins: Instr) -> str | None:
        """Add ``ins`` to the executor; None when added, else why it cannot be bound."""
        return _BIND[ins.KIND](self, ins)

    def release_memory(self) -> None:
        """Free the arenas kept between calls (calls running now keep theirs until they return)."""
        self.release_arenas()

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """Names of the nodes this loop runs through Python (its Program's PYCALLs)."""
        return self.program.fallbacks

    def run_timed(  # type: ignore[override]
        self, inputs: list[Any] | tuple[Any, ...], names: tuple[str, ...] | None = None
    ) -> tuple[Any, list[tuple[int, int, int]]]:
        """Run once through the compiled loop's instrumented variant; also return
        ``(node_index, start_ns, end_ns)`` for every node run (same contract as
        :meth:`PythonLoop.run_timed`; ``names`` given means torch.profiler ranges are wanted)."""
        out, flat = super().run_timed(inputs, names is not None)
        nodes = self._node_of_pc
        return out, [(nodes[flat[i]], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]

    def _execution_error(self, pc: int, regs: list[Any], exc: BaseException) -> BaseException:
        return instruction_error(self.program, pc, regs, exc)


# How each kind is added to the compiled loop's executor (its ``add_<kind>``): the binder returns
# None when added, else why the instruction cannot be bound. One entry per kind of
# fxrt.exec.instructions.KINDS (tests/test_kinds.py).


def _plain(ins: Call) -> tuple[Any, ...]:
    schema = ins.target._schema
    return (
        ins.target._op,
        str(schema.name),
        schema.overload_name,
        tuple(ins.args),
        dict(ins.kwargs),
        list(ins.outputs),
    )


def _bind_out(ex: NativeLoop, ins: OutCall) -> str | None:
    out = ins.out_target._schema
    return ex.add_out(
        _plain(ins),
        ins.multi,
        ins.slot,
        str(out.name),
        out.overload_name,
        tuple(ins.out_args),
        dict(ins.out_kwargs),
        ins.elementwise,
    )


def _bind_view(ex: NativeLoop, ins: View) -> str | None:
    kind = _VIEW_KINDS[ins.view]
    return ex.add_view(
        _plain(ins), kind, ins.multi, ins.always, list(ins.ints), list(ins.strides), ins.offset
    )


def _bind_kernel(ex: NativeLoop, ins: Kernel) -> str | None:
    kinds = [_KERNEL_PARAMS[p] for p in ins.target.params]
    return ex.add_kernel(ins.target, tuple(ins.args), ins.target.address, kinds, ins.outputs[0])


_BIND: dict[str, Callable[[NativeLoop, Any], str | None]] = {
    "CALL": lambda ex, ins: ex.add_call(_plain(ins), ins.multi),
    "OUT": _bind_out,
    "ALLOC": lambda ex, ins: ex.add_alloc(_plain(ins), ins.slot, ins.cpu),
    "VIEW": _bind_view,
    "SYM": lambda ex, ins: ex.add_sym(
        ins.target, _SYM_KINDS[ins.op], tuple(ins.args), ins.outputs[0]
    ),
    "KERNEL": _bind_kernel,
    "PYCALL": lambda ex, ins: ex.add_pycall(
        ins.target, tuple(ins.args), dict(ins.kwargs), list(ins.outputs), ins.multi
    ),
    "FREE": lambda ex, ins: ex.add_free(list(ins.regs)),
    "STREAM": lambda ex, ins: ex.add_stream(ins.stream),
    "RECORD": lambda ex, ins: ex.add_record(ins.stream, ins.event),
    "WAIT": lambda ex, ins: ex.add_wait(ins.stream, list(ins.events), list(ins.protect)),
}


def _demoted(ins: Instr, why: str) -> Instr:
    """What runs ``ins`` when the compiled loop cannot bind it: OUT, ALLOC and VIEW as their plain
    CALL, a CALL, SYM step or KERNEL as the Python call the Python loop makes."""
    if isinstance(ins, Call) and type(ins) is not Call:
        return ins.plain()
    reason = f"{Op.of(ins.target).name}: {why}"
    return PyCall(ins.node, ins.target, ins.args, ins.kwargs, ins.outputs, ins.multi, reason)


def _input_error(specs: tuple[InputSpec, ...], inputs: Any) -> BaseException:
    """The error the Python loop raises for inputs the compiled loop found mismatched."""
    try:
        check_inputs(specs, inputs)
    except InputError as e:
        return e
    return InputError("inputs do not match the compiled graph")  # not reached: same checks


__all__ = [
    "ExtensionStatus",
    "NativeLoop",
    "NativeReplayIndex",
    "extension_status",
    "native_available",
    "set_instrumenting",
]
