"""What every call checks before it runs, decided once at lowering and read by both loops.

:func:`~fxrt.exec.program.lower` puts a :class:`CallGuards` in the Program: the input specs
(:mod:`fxrt.exec.inputs`), the inputs the arena requires in their compiled size and dtype, and
whether a graph constant requires grad. Per call, a loop then decides two things from it and from
the thread's state, the Python loop with the functions below and the compiled loop with their C++
twins in ``fxrt/_speedups/loop.h`` (tests run both on the same programs):

* whether ``__torch_function__`` must see the call's ops (:func:`torch_function_active`): then
  each op runs through its Python form (``torch.ops``), without the arena;
* whether the call may use the arena (:func:`arena_allowed`): not when autograd could record it
  (``out=`` ops refuse inputs that require grad), when a ``TorchDispatchMode`` is active (it must
  see the graph's own ops), when new memory must be filled (deterministic mode), or when an input
  does not have the size and dtype the arena was planned for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .inputs import InputSpec


@dataclass(frozen=True)
class CallGuards:
    input_specs: tuple[InputSpec, ...] = ()  # checked on every call (empty: check_inputs off)
    # (input position, shape, dtype) a call must match to use the arena.
    arena_inputs: tuple[tuple[int, tuple[int, ...], torch.dtype], ...] = ()
    constants_need_grad: bool = False  # in grad mode, such a call runs without the arena


def torch_function_active(inputs: Sequence[Any]) -> bool:
    """A TorchFunctionMode is active or an input overrides ``__torch_function__``: the call's
    ops must go through ``torch.ops``, without the arena."""
    return torch._C._is_torch_function_mode_enabled() or torch._C._has_torch_function(inputs)


def fills_uninitialized_memory() -> bool:
    """``torch.use_deterministic_algorithms(True)`` with ``fill_uninitialized_memory``: new
    tensors are filled (NaN), which a reused arena slot is not."""
    return (
        torch.are_deterministic_algorithms_enabled()
        and torch.utils.deterministic.fill_uninitialized_memory
    )


def arena_allowed(guards: CallGuards, inputs: Sequence[Any]) -> bool:
    """Whether this call may use the arena (see the module docstring); the caller has checked
    that ``__torch_function__`` is not active."""
    if torch._C._len_torch_dispatch_stack() or fills_uninitialized_memory():
        return False
    if torch.is_grad_enabled() and (
        guards.constants_need_grad
        or any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
    ):
        return False
    for pos, shape, dtype in guards.arena_inputs:
        x = inputs[pos]
        if not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype != dtype:
            return False
    return True


__all__ = ["CallGuards", "arena_allowed", "fills_uninitialized_memory", "torch_function_active"]
