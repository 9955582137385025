"""``compile_graph``: FX GraphModule -> IR -> verify -> plan -> lower -> executor."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx

from .config import CompilerConfig
from .exec.interp import PythonLoop
from .exec.plan import Plan, plan_lifetimes
from .exec.program import Program, lower
from .ir import Graph, from_fx, graph_to_text, verify


class CompiledGraph:
    """A compiled graph: call it with the graph's flat inputs.

    ``cg(x, y)`` takes the inputs as arguments. Called with one list, ``cg([x, y])``, it follows
    AOTAutograd's boxed convention, so a CompiledGraph can be returned from an AOTAutograd
    ``fw_compiler`` as it is. Graph inputs are tensors, scalars, SymInts or None, never lists, so
    the two forms cannot be confused.

    Attributes:
        graph: the fxrt IR (``print(cg.graph_text())`` to read it).
        plan: the lifetime plan (FREE positions, predicted peak bytes).
        program: the flat Program both loops run; ``print(cg.program)`` lists it.
        executor: the name of the loop that runs it: ``"python"`` or ``"cpp"``.
    """

    def __init__(self, graph: Graph, plan: Plan, program: Program, config: CompilerConfig):
        # An instance attribute, not a class one: torch's wrappers (``functools.wraps``) copy the
        # instance ``__dict__``, and AOTAutograd reads the flag from the wrapper.
        self._boxed_call = True
        self.graph = graph
        self.plan = plan
        self.program = program
        self.config = config
        self._loop = PythonLoop(program)
        self.executor: str = self._loop.name

    def __call__(self, *args: Any) -> Any:
        if len(args) == 1 and type(args[0]) is list:
            return self._loop(args[0])
        return self._loop(args)

    def graph_text(self) -> str:
        return graph_to_text(self.graph)

    def __repr__(self) -> str:
        return (
            f"CompiledGraph({len(self.graph.nodes)} nodes, {len(self.program.code)} "
            f"instructions, executor={self.executor!r})"
        )


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any] | None = None,
    config: CompilerConfig | None = None,
) -> CompiledGraph:
    """Compile an ATen-level GraphModule with fxrt.

    Args:
        gm: the graph, e.g. as AOTAutograd or ``torch.export`` produce it.
        example_inputs: example (or fake) inputs, used for metadata the graph lacks.
        config: compiler options; defaults to ``CompilerConfig()`` (environment-driven).

    Returns:
        A :class:`CompiledGraph` that replaces ``gm``'s execution.
    """
    config = config or CompilerConfig()
    graph = from_fx(gm, example_inputs)
    if config.verify:
        verify(graph)
    plan = plan_lifetimes(graph)
    program = lower(graph, plan)
    return CompiledGraph(graph, plan, program, config)


def get_compiler(
    config: CompilerConfig | None = None,
) -> Callable[[torch.fx.GraphModule, Sequence[Any]], CompiledGraph]:
    """Return ``(gm, example_inputs) -> CompiledGraph`` for use as an AOTAutograd
    ``fw_compiler``/``bw_compiler`` (how third-party graph compilers integrate)."""
    config = config or CompilerConfig()

    def fxrt_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledGraph:
        return compile_graph(gm, example_inputs, config)

    return fxrt_compiler
