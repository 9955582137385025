"""Inductor's FX host graph -> an fxrt CompiledGraph.

With ``torch._inductor.config.fx_wrapper`` Inductor describes its host wrapper (the code that
allocates buffers, makes views, calls extern ATen kernels and its own generated kernels, in order)
as a ``torch.fx.GraphModule``. :func:`compile_host_graph` compiles it with
:func:`fxrt.compile_graph` under ``inductor_host_graph=True``, so the pipeline first runs the four
rewrites of :mod:`fxrt.passes.host_graph` (Python-level calls to ATen overloads, allocations
folded into the extern kernels that fill them, views the host graph does not need dropped, the
rest made ``fxrt::reinterpret_tensor`` views), as declared stages, and without fxrt's on-disk
cache: the graph calls generated kernels, which the artifact format cannot name, so it would
never be stored. The compiled graphs are kept (weakly) for :func:`compiled_host_graphs`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

from ..compiler import CompiledGraph, compile_graph
from ..config import CompilerConfig

stats: Counter[str] = Counter()  # "host_graphs": host graphs compiled with fxrt
_compiled: list[weakref.ref[CompiledGraph]] = []
_compiled_lock = threading.Lock()


def compile_host_graph(gm: torch.fx.GraphModule, config: CompilerConfig) -> CompiledGraph:
    """Compile Inductor's FX host graph ``gm`` with fxrt (rewriting it in place first).

    Args:
        gm: the host graph ``WrapperFxCodegen`` produced; its placeholders carry fake ``val``s.
        config: fxrt's options (``pure_python`` picks the loop); its ``cache`` is ignored.

    Returns:
        The compiled graph; call it with the host graph's flat inputs.
    """
    cg = compile_graph(gm, None, dataclasses.replace(config, cache=False, inductor_host_graph=True))
    stats["host_graphs"] += 1
    with _compiled_lock:
        _compiled[:] = [r for r in _compiled if r() is not None]
        _compiled.append(weakref.ref(cg))
    return cg


@contextlib.contextmanager
def capturing_modules() -> Iterator[list[Any]]:
    """Collect the modules Inductor compiles inside the block: its Python wrapper module, or the
    FileBackedGraphModule holding an FX host graph (for tests and benchmarks)."""
    from torch._inductor.graph import GraphLowering

    found: list[Any] = []
    original = GraphLowering.compile_to_module

    def spy(self: GraphLowering) -> Any:
        found.append(original(self))
        return found[-1]

    GraphLowering.compile_to_module = spy
    try:
        yield found
    finally:
        GraphLowering.compile_to_module = original


def compiled_host_graphs() -> list[CompiledGraph]:
    """The host graphs fxrt has compiled that are still alive, oldest first."""
    with _compiled_lock:
        return [cg for cg in (r() for r in _compiled) if cg is not None]


__all__ = ["capturing_modules", "compile_host_graph", "compiled_host_graphs", "stats"]
