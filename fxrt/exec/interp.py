"""The pure-Python loop: runs a Program instruction by instruction.

It is the reference the compiled loop is tested against and the executor used when
``FXRT_PURE_PYTHON=1`` or the extension is unavailable. Instructions are first turned into plain
tuples with their argument lists pre-built (a list template with register slots to fill), so the
loop itself does no analysis. Every kind runs its plain form (ATen ops through ``torch.ops``,
which ``__torch_function__`` sees), except OUT and ALLOC on calls with an arena: VIEW and SYM
have no cheaper form in Python, and their plain form gives the same values. The per-call guards
come from :mod:`fxrt.exec.guards`, errors from :func:`fxrt.errors.instruction_error`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import has_refs, instruction_error
from ..ir.graph import Ref, map_refs
from .guards import arena_allowed, torch_function_active
from .inputs import check_inputs
from .program import Alloc, Call, Free, OutCall, Program, Stream

# Instruction tuples: (_FREE, regs), (_CALL, node, fn, loaded, outputs, multi) for every kind
# that runs its plain form (CALL, VIEW, SYM, PYCALL, and OUT/ALLOC without an arena), and on
# calls with an arena (_OUT, node, plain, out_fn, out_loaded, slot), (_SLOT, node, plain, slot).
_CALL, _FREE, _OUT, _SLOT = 0, 1, 2, 3


def _arg_loader(args: tuple, kwargs: dict) -> tuple:
    """Split a call's arguments into a constant template and the register reads that fill it."""
    tmpl, fills, deep = [], [], []
    for pos, a in enumerate(args):
        if isinstance(a, Ref):
            tmpl.append(None)
            fills.append((pos, a.id))
        elif has_refs(a):
            tmpl.append(None)
            deep.append((pos, a))
        else:
            tmpl.append(a)
    kw_const = {k: v for k, v in kwargs.items() if not has_refs(v)}
    kw_deep = tuple((k, v) for k, v in kwargs.items() if has_refs(v))
    return tmpl, tuple(fills), tuple(deep), kw_const, kw_deep


def _invoke(fn: Any, loaded: tuple, regs: list[Any]) -> Any:
    """Call ``fn`` with the arguments ``_arg_loader`` prepared, read from the registers."""
    tmpl, fills, deep, kw_const, kw_deep = loaded
    a = tmpl.copy()
    for p, r in fills:
        a[p] = regs[r]
    for p, tree in deep:
        a[p] = map_refs(tree, lambda ref: regs[ref.id])
    if kw_deep:
        kw = dict(kw_const)
        for k, tree in kw_deep:
            kw[k] = map_refs(tree, lambda ref: regs[ref.id])
        return fn(*a, **kw)
    return fn(*a, **kw_const)


def _step(ins: tuple, regs: list[Any], arena: list[Any] | None) -> None:
    """Execute one instruction tuple against the register file (and the call's arena)."""
    kind = ins[0]
    if kind is _FREE:
        for r in ins[1]:
            regs[r] = None
        return
    if kind is _SLOT:  # ALLOC with an arena: the slot is the result
        regs[ins[2][4][0]] = arena[ins[3]]
        return
    if kind is _OUT:
        _, _node, plain, out_fn, out_loaded, slot = ins
        for k, o in enumerate(plain[4]):  # a node's results: the slots from `slot` on
            regs[o] = arena[slot + k]
        try:
            _invoke(out_fn, out_loaded, regs)  # writes the slot, passed as out=
            return
        except Exception:
            ins = plain  # the plain call runs it instead, and raises its own error if any
    _, _node, fn, loaded, outs, multi = ins
    res = _invoke(fn, loaded, regs)
    if multi:
        for o, v in zip(outs, res):
            regs[o] = v
    else:
        regs[outs[0]] = res


class PythonLoop:
    """Executes a :class:`Program` in Python."""

    name = "python"

    def __init__(self, program: Program, *, arena: bool = True, arena_max_idle: int = 2):
        self.program = program
        self.arena_max_idle = arena_max_idle
        template: list[Any] = [None] * program.n_regs
        for reg, obj in program.constants:
            template[reg] = obj
        self.template = template
        self.inputs = program.inputs
        self.n_inputs = len(program.inputs)
        self.guards = program.guards
        code: list[tuple] = []
        for ins in program.code:
            if isinstance(ins, Free):
                code.append((_FREE, ins.regs))
                continue
            if isinstance(ins, Stream):
                # Program order is a valid schedule of a multi-stream program: STREAM, RECORD
                # and WAIT have nothing to do here (a FREE of nothing).
                code.append((_FREE, ()))
                continue
            # An ATen op through torch.ops' Python binding (``_op``): what __torch_function__
            # sees; SYM and PYCALL targets are Python callables already.
            fn = ins.target._op if isinstance(ins, Call) else ins.target
            loaded = _arg_loader(ins.args, ins.kwargs)
            code.append((_CALL, ins.node, fn, loaded, ins.outputs, ins.multi))
        self.code = tuple(code)
        self.arena = program.arena if arena else None
        if self.arena is not None:
            self.arena_code = tuple(
                self._arena_instruction(ins, plain) for ins, plain in zip(program.code, self.code)
            )
            # Arenas not in use, one pool per inference mode (the tensors of an arena made in
            # inference mode are inference tensors, which normal mode may not write) and current
            # stream of the arena's device (a call's work on one stream may still be reading
            # its arena when a call on another starts).
            self._pools: dict[tuple[bool, Any], list] = {}
            self._device = torch.device(self.arena.device)
        out = program.output
        if isinstance(out, (tuple, list)) and all(isinstance(o, Ref) for o in out):
            regs = tuple(o.id for o in out)
            kind = tuple if isinstance(out, tuple) else list
            self.build_output: Callable[[list], Any] = lambda r: kind([r[i] for i in regs])
        else:
            self.build_output = lambda r: map_refs(out, lambda ref: r[ref.id])

    def _registers(self, inputs: list[Any] | tuple[Any, ...]) -> list[Any]:
        if len(inputs) != self.n_inputs:
            raise TypeError(f"compiled graph takes {self.n_inputs} inputs, got {len(inputs)}")
        if self.guards.input_specs:
            check_inputs(self.guards.input_specs, inputs)
        regs = self.template.copy()
        for r, x in zip(self.inputs, inputs):
            regs[r] = x
        return regs

    @staticmethod
    def _arena_instruction(ins: Any, plain: tuple) -> tuple:
        """The instruction tuple on calls with an arena (VIEWs run their plain form here)."""
        if isinstance(ins, OutCall):
            loaded = _arg_loader(ins.out_args, ins.out_kwargs)
            return (_OUT, ins.node, plain, ins.out_target._op, loaded, ins.slot)
        if isinstance(ins, Alloc) and ins.slot >= 0:
            return (_SLOT, ins.node, plain, ins.slot)
        return plain

    def take_arena(self, inputs: list[Any] | tuple[Any, ...]) -> list[Any] | None:
        """An arena for this call from the pool (a new one when it is empty), or None when the
        call must run without: there is none, autograd could record the call, or an input does
        not have the size and dtype the graph was compiled for. The caller gives it back with
        :meth:`give_back` once the call succeeded (an arena a failed call used is dropped).

        Neither does a call that ``__torch_function__`` or a ``TorchDispatchMode`` sees: it must
        see the graph's own ops."""
        arena = self.arena
        if arena is None or torch_function_active(inputs) or not arena_allowed(self.guards, inputs):
            return None
        pool = self._pools.get(self._pool_key())
        try:
            return pool.pop()
        except (AttributeError, IndexError):
            return arena.allocate()

    def _pool_key(self) -> tuple[bool, Any]:
        device = self._device
        stream = None
        if device.type != "cpu":
            try:
                s = torch.accelerator.current_stream(device)
                stream = (s.device_index, s.stream_id)
            except (RuntimeError, ValueError):  # a device without streams
                stream = None
        return torch.is_inference_mode_enabled(), stream

    def give_back(self, tensors: list[Any] | None) -> None:
        if tensors is not None:  # the call ran in the inference mode and stream it started in
            pool = self._pools.setdefault(self._pool_key(), [])
            if len(pool) < self.arena_max_idle:  # more are freed: threads come and go
                pool.append(tensors)

    def idle_arenas(self) -> int:
        """How many arenas are kept between calls now."""
        return sum(map(len, self._pools.values())) if self.arena is not None else 0

    def release_memory(self) -> None:
        """Free the arenas kept between calls (calls running now keep theirs until they return)."""
        if self.arena is not None:
            self._pools.clear()

    def __call__(self, inputs: list[Any] | tuple[Any, ...]) -> Any:
        regs = self._registers(inputs)
        arena = self.take_arena(inputs)
        code = self.code if arena is None else self.arena_code
        pc = 0
        try:
            for pc, ins in enumerate(code):  # noqa: B007 - pc names the failing instruction
                _step(ins, regs, arena)
        except Exception as e:
            raise self.error(pc, regs, e) from e
        self.give_back(arena)
        return self.build_output(regs)

    run = __call__  # the same as calling it (CompiledGraph runs a loop with ``run``)

    def run_observed(
        self,
        inputs: list[Any] | tuple[Any, ...],
        after_node: Callable[[int, list[Any], int, int], None],
        names: tuple[str, ...] | None = None,
    ) -> Any:
        """Run like ``__call__``, calling ``after_node(node_index, registers, start_ns, end_ns)``
        right after each node runs (before the FREEs that follow it). With ``names`` (one per
        node), each node also runs inside a ``torch.profiler.record_function`` range of its name.

        The instrumented loop for profiling and memory measurement: ``__call__`` pays nothing for
        it."""
        regs = self._registers(inputs)
        arena = self.take_arena(inputs)
        code = self.code if arena is None else self.arena_code
        clock = time.perf_counter_ns
        pc = 0
        try:
            for pc, ins in enumerate(code):  # noqa: B007
                if ins[0] is _FREE:
                    _step(ins, regs, arena)
                    continue
                if names is not None:
                    with torch.profiler.record_function(names[ins[1]]):
                        t0 = clock()
                        _step(ins, regs, arena)
                        t1 = clock()
                else:
                    t0 = clock()
                    _step(ins, regs, arena)
                    t1 = clock()
                after_node(ins[1], regs, t0, t1)
        except Exception as e:
            raise self.error(pc, regs, e) from e
        self.give_back(arena)
        return self.build_output(regs)

    def run_timed(
        self, inputs: list[Any] | tuple[Any, ...], names: tuple[str, ...] | None = None
    ) -> tuple[Any, list[tuple[int, int, int]]]:
        """Run once; also return ``(node_index, start_ns, end_ns)`` for every node run."""
        timings: list[tuple[int, int, int]] = []
        out = self.run_observed(inputs, lambda i, _r, a, b: timings.append((i, a, b)), names)
        return out, timings

    def error(self, pc: int, regs: list[Any], exc: BaseException) -> BaseException:
        return instruction_error(self.program, pc, regs, exc)


__all__ = ["PythonLoop"]
