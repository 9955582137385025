"""Graph passes on the fxrt IR: the built-in passes, their optimization levels, user passes.

A pass is a function ``Graph -> Graph`` named with a verb, one file each (the one exception:
:mod:`~fxrt.passes.host_graph`, FX rewrites of Inductor's host graph, run before the conversion).
:data:`PASSES` names the built-in ones and :data:`LEVELS` (from :mod:`fxrt.config`) the lists
``opt_level`` selects (``CompilerConfig.pass_names()`` says which run). Running them is the
compile pipeline's job (:mod:`fxrt.pipeline`): it runs each configured pass as a stage of its
own, with the other rewrites of the pipeline, verifies the graph after it if it changed, and
records a :class:`PassRecord` (name, wall time with verification, whether the graph's text
changed); a pass that raises fails the compile with a :class:`PassError` naming it. User passes
(TorchAir's interface, on FX) are :mod:`fxrt.passes.user`.

The analyses passes share (alias sets, purity, writes) are :mod:`fxrt.analysis.values`, on top of
:mod:`fxrt.ops.aliasing`: passes are functions of the IR; nothing here imports the planner,
the arena or the lowering.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import LEVELS, PASS_NAMES  # noqa: F401 (re-exported)
from ..ir import Graph
from ..records import PassError, PassRecord
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
# fxrt.config validates options against PASS_NAMES, without importing a pass: the same names, in
# the same order (tests/test_passes.py checks it).


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
