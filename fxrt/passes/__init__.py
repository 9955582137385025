"""Graph passes on the fxrt IR and the pass manager.

A pass is a function ``Graph -> Graph`` named with a verb. The manager runs the configured list in
order, runs the verifier after each one (when ``config.verify``), and records each pass's name,
wall time and whether it changed the graph (compared by the graph's canonical text).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from ..ir import Graph, graph_to_text, verify
from .eliminate_common_subexpressions import eliminate_common_subexpressions
from .eliminate_dead_code import eliminate_dead_code
from .fold_constants import DEFAULT_MAX_BYTES, fold_constants
from .remove_noops import remove_noops

PASSES: dict[str, Callable[[Graph], Graph]] = {
    "eliminate_dead_code": eliminate_dead_code,
    "remove_noops": remove_noops,
    "eliminate_common_subexpressions": eliminate_common_subexpressions,
    "fold_constants": fold_constants,
}

# Optimization levels: 0 runs nothing; 1 the cheap clean-ups; 2 (default) adds constant folding.
LEVELS: dict[int, tuple[str, ...]] = {
    0: (),
    1: ("remove_noops", "eliminate_common_subexpressions", "eliminate_dead_code"),
    2: (
        "fold_constants",
        "remove_noops",
        "eliminate_common_subexpressions",
        "eliminate_dead_code",
    ),
}


class PassError(RuntimeError):
    """A graph pass failed; the message names the pass."""


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    changed: bool


def run_passes(
    graph: Graph,
    names: Sequence[str],
    *,
    check: bool = True,
    fold_max_bytes: int | None = None,
    foldable: Collection[int] | None = None,
    on_pass: Callable[[str, Graph], None] | None = None,
) -> tuple[Graph, list[PassRecord]]:
    """Run the named passes in order; return the graph and one record per pass.

    ``foldable`` names the constants ``fold_constants`` may fold through (None: all of them)."""
    records = []
    for name in names:
        fn = PASSES[name]
        before = graph_to_text(graph)
        t0 = time.perf_counter()
        try:
            if name == "fold_constants":
                graph = fold_constants(
                    graph, fold_max_bytes or DEFAULT_MAX_BYTES, foldable=foldable
                )
            else:
                graph = fn(graph)
            if check:
                verify(graph)
        except Exception as e:
            raise PassError(f"fxrt pass {name!r} failed: {type(e).__name__}: {e}") from e
        records.append(PassRecord(name, time.perf_counter() - t0, graph_to_text(graph) != before))
        if on_pass is not None:
            on_pass(name, graph)
    return graph, records


__all__ = [
    "LEVELS",
    "PASSES",
    "PassError",
    "PassRecord",
    "eliminate_common_subexpressions",
    "eliminate_dead_code",
    "fold_constants",
    "remove_noops",
    "run_passes",
]
