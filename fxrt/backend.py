"""The ``torch.compile`` entry: ``torch.compile(model, backend="fxrt")``.

Dynamo hands over a Torch-level FX graph; AOTAutograd lowers it to ATen (functionalized, input
mutations kept in the graph as ``copy_``), partitions forward and backward when inputs require grad,
and both graphs are compiled by fxrt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.fx

from .compiler import get_compiler
from .config import CompilerConfig


def backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """The fxrt ``torch.compile`` backend.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its (fake) example inputs.
        mode: torch.compile's ``mode``.
        options: torch.compile's ``options``: keys of :class:`fxrt.CompilerConfig`.

    Raises:
        ValueError: an unknown option or mode.
    """
    from torch._dynamo.backends.common import aot_autograd

    config = CompilerConfig.from_options(mode, options)
    compiler = get_compiler(config)
    return aot_autograd(
        fw_compiler=compiler, bw_compiler=compiler, keep_inference_input_mutations=True
    )(gm, example_inputs)
