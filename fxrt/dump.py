"""``FXRT_DUMP_DIR``: write what each compiled graph went through, one folder per graph.

Files, numbered in the order of the compile pipeline's stages (:mod:`fxrt.pipeline`, whose
manager writes them): ``00_input_fx.txt`` (the FX graph fxrt received), ``01_after_pre_pass_fx.txt``
(if a user pre pass ran), ``NN_after_from_fx.txt`` and ``NN_after_apply_kernel_overrides.txt``
(the IR), ``NN_after_<pass>.txt`` (the IR after each built-in pass), ``NN_after_post_pass_fx.txt``
(if a user post pass ran: the FX graph it left), ``NN_after_use_own_ops.txt`` (the IR),
``NN_after_plan_lifetimes.txt`` (live bytes and FREEs per node), ``NN_after_plan_arena.txt`` (the
arena's slots) and ``NN_after_lower.txt`` (the lowered program). Then, unnumbered: ``ir.txt``
(the final IR), ``program.txt`` (the listing as the chosen loop runs it, with its FREEs) and
``ir.dot`` (the IR as a Graphviz graph). A cache hit writes ``00_input_fx.txt``,
``cache_hit.txt`` and those three.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch.fx

from .exec.program import Program
from .ir import Graph, graph_to_text, refs_in
from .ir.printer import format_arg

_counter = itertools.count()


class Dumper:
    def __init__(self, root: str):
        self.dir = Path(root) / f"graph_{os.getpid()}_{next(_counter):04d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.step = 0

    def write(self, name: str, text: str) -> None:
        (self.dir / name).write_text(text + "\n")

    def numbered(self, name: str, text: str) -> None:
        self.write(f"{self.step:02d}_{name}", text)
        self.step += 1

    def fx(self, name: str, gm: torch.fx.GraphModule) -> None:
        self.numbered(name, gm.print_readable(print_output=False))

    def ir(self, name: str, graph: Graph) -> None:
        self.numbered(name, graph_to_text(graph))

    def final(self, graph: Graph, program: Program) -> None:
        self.write("ir.txt", graph_to_text(graph))
        self.write("program.txt", str(program))
        self.write("ir.dot", graph_to_dot(graph))


def graph_to_dot(graph: Graph) -> str:
    """The IR as a Graphviz digraph: inputs and constants as ellipses, nodes as boxes."""
    names = {v.id: v.name for v in graph.values}
    producer: dict[int, str] = {}
    lines = ["digraph fxrt {", "  rankdir=TB;", '  node [fontname="monospace"];']
    for vid in graph.inputs:
        producer[vid] = f"v{vid}"
        lines.append(f'  v{vid} [shape=ellipse, label="{names[vid]}"];')
    for vid, c in graph.constants.items():
        producer[vid] = f"v{vid}"
        label = f"{names[vid]}\\n{format_arg(c)}".replace('"', "'")
        lines.append(f'  v{vid} [shape=ellipse, style=dashed, label="{label}"];')
    for i, node in enumerate(graph.nodes):
        meta = graph.values[node.outputs[0]].meta
        label = f"{node.name}\\n{node.op.name}" + (f"\\n{meta}" if meta else "")
        lines.append(f'  n{i} [shape=box, label="{label}"];')
        for vid in dict.fromkeys(node.input_ids()):
            lines.append(f"  {producer[vid]} -> n{i};")
        for vid in node.outputs:
            producer[vid] = f"n{i}"
    lines.append('  out [shape=doublecircle, label="output"];')
    for vid in dict.fromkeys(refs_in(graph.output)):
        lines.append(f"  {producer[vid]} -> out;")
    lines.append("}")
    return "\n".join(lines)
