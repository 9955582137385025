"""Measured memory: replay a Program and record the bytes its intermediates actually hold.

After each node runs (before the FREEs that follow it), the registers are scanned for tensors; each
distinct storage that does not belong to a graph input or constant counts once with its size. The
plan's prediction (``Plan.live_bytes``) is computed the same way from static metadata, so the two
agree whenever every fresh storage has a static size.
"""

from __future__ import annotations

from typing import Any

import torch

from .interp import PythonLoop
from .program import Program


def _storages(x: Any, out: dict[int, int]) -> None:
    if isinstance(x, torch.Tensor):
        if x.layout == torch.strided and not x.is_meta:
            st = x.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    elif isinstance(x, (list, tuple)):
        for y in x:
            _storages(y, out)


def measure_live_bytes(program: Program, inputs: list[Any] | tuple[Any, ...]) -> list[int]:
    """Run ``program`` on ``inputs`` and return the live intermediate bytes after each node."""
    owned: dict[int, int] = {}
    _storages(list(inputs), owned)
    _storages([c for _, c in program.constants], owned)
    live: list[int] = []

    def after_node(_node: int, regs: list[Any]) -> None:
        seen: dict[int, int] = {}
        _storages(regs, seen)
        live.append(sum(n for ptr, n in seen.items() if ptr not in owned and ptr != 0))

    PythonLoop(program).run_observed(inputs, after_node)
    return live
