"""Graph passes on the fxrt IR: the built-in passes, their optimization levels, user passes.

A pass is a function ``Graph -> Graph`` named with a verb, one file each (the one exception:
:mod:`~fxrt.passes.host_graph`, FX rewrites of Inductor's host graph, run before the conversion).
:data:`PASSES` names the built-in ones and :data:`LEVELS` the lists ``opt_level`` selects
(``CompilerConfig.pass_names()`` says which run). Running them is the compile pipeline's job
(:mod:`fxrt.pipeline`): it runs each configured pass as a stage of its own, with the other rewrites
of the pipeline, verifies the graph after it if it changed, and records a :class:`PassRecord` (name,
wall time with verification, whether the graph's text changed); a pass that raises fails the compile
with a :class:`PassError` naming it. User passes (TorchAir's interface, on FX) are
:mod:`fxrt.passes.user`.

The analyses passes share (alias sets, purity, writes) are :mod:`fxrt.analysis.values`, on top of
:mod:`fxrt.ops.aliasing`: passes are functions of the IR; nothing here imports the planner,
the arena or the lowering.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..ir import Graph
from .eliminate_common_subexpressions import eliminate_common_subexpressions
from .eliminate_dead_code import eliminate_dead_code
from .fold_constants import DEFAULT_MAX_BYTES, fold_constants
from .fuse_attention import fuse_attention
from .fuse_patterns import fuse_patterns
from .remove_noops import remove_noops

# ``fold_constants`` takes two more arguments, from the config (see fxrt.pipeline).
PASSES: dict[str, Callable[..., Graph]] = {
    "eliminate_dead_code": eliminate_dead_code,
    "remove_noops": remove_noops,
    "eliminate_common_subexpressions": eliminate_common_subexpressions,
    "fold_constants": fold_constants,
    "fuse_attention": fuse_attention,
    "fuse_patterns": fuse_patterns,
}

# Optimization levels: 0 runs nothing; 1 the cheap clean-ups; 2 (default) adds constant folding,
# attention fusion (after folding, which turns a mask made in forward into a constant) and the
# fused patterns (fxrt.patterns; after attention fusion, whose K/V they may un-repeat).
LEVELS: dict[int, tuple[str, ...]] = {
    0: (),
    1: ("remove_noops", "eliminate_common_subexpressions", "eliminate_dead_code"),
    2: (
        "fold_constants",
        "fuse_attention",
        "fuse_patterns",
        "remove_noops",
        "eliminate_common_subexpressions",
        "eliminate_dead_code",
    ),
}


class PassError(RuntimeError):
    """A graph pass failed; the message names the pass."""


@dataclass(frozen=True)
class PassRecord:
    """What one stage of the compile pipeline did: its name, its wall time in seconds (its
    verification included) and whether it changed the graph's text."""

    name: str
    seconds: float
    changed: bool


__all__ = [
    "DEFAULT_MAX_BYTES",
    "LEVELS",
    "PASSES",
    "PassError",
    "PassRecord",
    "eliminate_common_subexpressions",
    "eliminate_dead_code",
    "fold_constants",
    "fuse_attention",
    "fuse_patterns",
    "remove_noops",
]
