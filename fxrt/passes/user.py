"""User graph passes, with TorchAir's interface so existing passes port unchanged.

``post_grad_custom_pre_pass`` and ``post_grad_custom_post_pass`` (options or CompilerConfig
fields) are called as ``fn(gm, example_inputs, config)`` on the ATen-level FX GraphModule, before
and after fxrt's built-in passes, and edit ``gm.graph`` in place. Node metadata (``meta["val"]``)
is recomputed after a user pass on fake copies of the example inputs, so nodes the pass added
get types too.

Both are stages of the compile pipeline (:mod:`fxrt.pipeline`): the pre pass runs on the FX graph
fxrt was handed, before its conversion to IR; the post pass on the IR turned back into FX
(:func:`fxrt.ir.to_fx.to_fx`), whose result is converted again. Only these two stages use FX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from ..records import PassError


def run_user_pass(
    fn: Callable[..., Any],
    which: str,
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any] | None,
    config: Any,
) -> torch.fx.GraphModule:
    name = getattr(fn, "__qualname__", None) or repr(fn)
    try:
        fn(gm, example_inputs, config)
        gm.graph.lint()
        gm.recompile()
    except Exception as e:
        raise PassError(f"user pass {which} ({name}) failed: {type(e).__name__}: {e}") from e
    if example_inputs is not None:
        _refresh_meta(gm, example_inputs)
    return gm


def _refresh_meta(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = torch._guards.detect_fake_mode(example_inputs) or FakeTensorMode(
        allow_non_fake_inputs=True
    )
    try:
        with torch.no_grad():
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(
                *[mode.from_tensor(x) if _is_real_tensor(x) else x for x in example_inputs]
            )
    except Exception:
        # Types of new nodes stay unknown (the planner then counts their bytes as unknown);
        # running the graph does not depend on them.
        pass


def _is_real_tensor(x: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(x, torch.Tensor) and not is_fake(x)


def replace_pattern(
    gm: torch.fx.GraphModule,
    pattern: Callable[..., Any],
    replacement: Callable[..., Any],
    example_inputs: Sequence[Any],
) -> int:
    """Replace every match of ``pattern`` in ``gm`` by ``replacement``; return the match count.

    ``pattern`` and ``replacement`` are Python functions of the same tensors; both are traced to
    ATen on ``example_inputs`` (``make_fx``) so they match the ATen-level graph fxrt compiles,
    then ``torch.fx.subgraph_rewriter`` does the matching and the rewrite.
    """
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.subgraph_rewriter import replace_pattern as fx_replace_pattern

    pattern_gm = make_fx(pattern)(*example_inputs)
    replacement_gm = make_fx(replacement)(*example_inputs)
    matches = fx_replace_pattern(gm, pattern_gm, replacement_gm)
    gm.recompile()
    return len(matches)
