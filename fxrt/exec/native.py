"""The compiled loop: runs a Program in C++ (``fxrt._speedups._loop``, see its ``loop.h``).

:class:`NativeLoop` hands the Program to the extension's ``Executor`` instruction by instruction,
in program order, so an instruction's index is the same in both loops:

* ``Call`` -> resolved once to a dispatcher op with its full boxed argument list. An op the
  dispatcher does not know, or a call that does not bind to its schema, runs as a Python call of
  ``target._op`` instead, exactly as the Python loop runs it (so it fails the same way too);
  :attr:`NativeLoop.fallbacks` lists those nodes on top of the Program's own fallbacks.
* ``PyCall`` -> a call back into Python inside the same loop.
* ``Free`` -> registers reset.

With an arena, the executor gets the arena's factory and input guards and each call its slot
(see :mod:`fxrt.exec.arena`); it decides per call whether to use one, as the Python loop does.

Loading: the extension is tied to the torch it was compiled against. This module imports it once,
when it is imported itself, and :func:`extension_status` says whether it can be used and why not.
The first time fxrt would have picked the compiled loop but cannot, :func:`native_available`
warns (once per process) and fxrt uses the Python loop.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ..errors import node_error
from ..ir.graph import Ref, map_refs
from .inputs import InputError, InputSpec, check_inputs
from .interp import PythonLoop, input_refs_of, torch_function_active
from .program import Call, Free, Program

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
    return ExtensionStatus(_loop, f"extension built for torch {built}", path, built)


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
else:

    class _Executor:  # the base NativeLoop gets when there is no extension; it refuses to build
        pass


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
        self.program = program
        self.release_gil = release_gil
        self._init_executor(Ref, program.n_regs, release_gil)
        self.set_inputs(list(program.inputs))
        for reg, obj in program.constants:
            self.set_constant(reg, obj)
        python_calls: list[int] = []
        for ins in program.code:
            if isinstance(ins, Free):
                self.add_free(list(ins.regs))
            elif not (isinstance(ins, Call) and self._add_native_call(ins)):
                # A PyCall, or an ATen call the dispatcher cannot run: call what the Python loop
                # calls, so that it runs (or fails) exactly as there.
                fn = ins.target._op if isinstance(ins, Call) else ins.target
                args, kwargs = tuple(ins.args), dict(ins.kwargs)
                self.add_pycall(fn, args, kwargs, list(ins.outputs), ins.multi)
                python_calls.append(ins.node)
        self.set_output(program.output)
        if program.arena is not None:
            guards = [
                (pos, torch.empty(shape, dtype=dtype, device="meta"))
                for pos, shape, dtype in program.arena.input_guards
            ]
            need_grad = any(
                isinstance(c, torch.Tensor) and c.requires_grad for _, c in program.constants
            )
            self.set_arena(program.arena.allocate, guards, need_grad, arena_max_idle)
        self.arena_max_idle = arena_max_idle
        if program.input_specs:
            specs = program.input_specs
            self.set_input_specs(
                [
                    (
                        spec.pos,
                        torch.empty(0, dtype=spec.meta.dtype, device="meta"),
                        spec.meta.device,
                        list(spec.sizes),
                        list(spec.strides),
                    )
                    for spec in specs
                ],
                lambda inputs: _input_error(specs, inputs),
            )
        self.set_names(
            [program.nodes[i.node].name if not isinstance(i, Free) else "" for i in program.code]
        )
        self._node_of_pc = tuple(-1 if isinstance(i, Free) else i.node for i in program.code)
        self._python_calls = tuple(python_calls)
        self._python_loop: PythonLoop | None = None

    def _add_native_call(self, ins: Call) -> bool:
        schema = ins.target._schema
        added = self.add_call(
            str(schema.name),
            schema.overload_name,
            tuple(ins.args),
            dict(ins.kwargs),
            list(ins.outputs),
            ins.multi,
        )
        if added and ins.inline_view:
            self.set_inline_view()
        if added and ins.slot >= 0:
            out = ins.out_target._schema if ins.out_target is not None else None
            self.set_arena_slot(
                ins.slot,
                str(out.name) if out else None,
                out.overload_name if out else None,
                tuple(ins.out_args),
                dict(ins.out_kwargs or {}),
            )
        return added

    def release_memory(self) -> None:
        """Free the arenas kept between calls (calls running now keep theirs until they return)."""
        self.release_arenas()
        if self._python_loop is not None:
            self._python_loop.release_memory()

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """Names of the nodes this loop runs through Python (the Program's fallbacks, and ATen
        calls the dispatcher cannot run natively)."""
        return tuple(self.program.nodes[i].name for i in self._python_calls)

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
        return _execution_error(self.program, pc, regs, exc)

    def _run_with_torch_function(self, inputs: list[Any] | tuple[Any, ...]) -> Any:
        # The Python loop calls ops through torch.ops, which honours __torch_function__ (a mode,
        # a tensor subclass input); the compiled loop calls them below that layer.
        return self.python_loop()(inputs)

    def python_loop(self) -> PythonLoop:
        """The Python loop over the same program, for calls ``__torch_function__`` must see."""
        if self._python_loop is None:
            self._python_loop = PythonLoop(self.program, arena_max_idle=self.arena_max_idle)
        return self._python_loop

    torch_function_active = staticmethod(torch_function_active)


def _input_error(specs: tuple[InputSpec, ...], inputs: Any) -> BaseException:
    """The error the Python loop raises for inputs the compiled loop found mismatched."""
    try:
        check_inputs(specs, inputs)
    except InputError as e:
        return e
    return InputError("inputs do not match the compiled graph")  # not reached: same checks


def _execution_error(
    program: Program, pc: int, regs: list[Any], exc: BaseException
) -> BaseException:
    """The error the Python loop raises when instruction ``pc`` fails (PythonLoop.error)."""
    ins = program.code[pc]
    if isinstance(ins, Free):
        return exc
    info = program.nodes[ins.node]
    args = [
        map_refs(a, lambda ref: regs[ref.id])
        for a in (*ins.args, *ins.kwargs.values())
        if input_refs_of(a)
    ]
    return node_error(info.name, info.op, info.stack_trace, args, exc)


__all__ = ["ExtensionStatus", "NativeLoop", "extension_status", "native_available"]
