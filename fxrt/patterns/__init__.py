"""Fused patterns: chains of small ATen ops that compute a known piece of math (RMSNorm, rotary
embeddings, a gated MLP's product, grouped-query attention's repeated K/V heads) replaced by one
call of the device's fused op.

The compile pipeline's ``fuse_patterns`` pass (:mod:`fxrt.passes.fuse_patterns`) applies every
registered pattern; :mod:`fxrt.patterns.builtin` has the built-in ones and what each matches,
:mod:`fxrt.patterns.npu` their Ascend targets. A pattern is a matcher plus targets per device
(:mod:`fxrt.patterns.registry`); a user or a vendor adds one with :func:`register_pattern`::

    import fxrt
    from fxrt.patterns import Match, Target

    def match_softplus(node, index):          # anchor: aten::log1p
        exp = index.only_for(node.args[0], "aten::exp")
        if exp is None:
            return None
        return Match((exp.args[0],), {}, [node.outputs[0]], [node, exp])

    fxrt.register_pattern(
        "softplus", match_softplus, {"cpu": Target(torch.ops.aten.softplus.default)},
        anchors=["aten::log1p"],
    )

and turns any pattern off for a compile with ``CompilerConfig(disable_patterns=["rotary"])``
(``FXRT_DISABLE_PATTERNS=rotary,gated_mlp``). :func:`pattern_counts` says how many fused calls of
each pattern a compiled graph holds.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from .match import GraphIndex
from .registry import (
    Made,
    Match,
    Pattern,
    Target,
    View,
    register_pattern,
    registered_patterns,
    registry_fingerprint,
    target_device,
    unregister_pattern,
    use_targets_of,
)

PREFIX = "fused_"  # a fused call's node is named fused_<pattern>[_N]
_NAME = re.compile(r"fused_(.+?)(?:_\d+)?$")


def pattern_counts(compiled: Any) -> dict[str, int]:
    """How many fused calls of each pattern a compiled graph (a ``CompiledGraph``, a loaded
    package, or an IR ``Graph``) holds; patterns with none are left out."""
    graph = getattr(compiled, "graph", compiled)
    counts: Counter[str] = Counter()
    for node in graph.nodes:
        m = _NAME.match(node.name)
        if m is not None:
            counts[m.group(1)] += 1
    return dict(counts)


from .builtin import BUILTIN, register_builtins  # noqa: E402  (needs the registry above)

register_builtins()

__all__ = [
    "BUILTIN",
    "PREFIX",
    "GraphIndex",
    "Made",
    "Match",
    "Pattern",
    "Target",
    "View",
    "pattern_counts",
    "register_pattern",
    "registered_patterns",
    "registry_fingerprint",
    "target_device",
    "unregister_pattern",
    "use_targets_of",
]
