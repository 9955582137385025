"""fxrt as vLLM's ``CompilerInterface`` (piecewise compilation, VLLM_COMPILE).

vLLM splits the model's Dynamo graph at its attention ops and asks the interface to compile each
piece for a range of token counts (one symbolic size). :meth:`FxrtCompiler.compile` runs fxrt's
``torch.compile`` backend on the piece and returns, as vLLM's handle, the key of the piece's
entry in fxrt's compile cache; on a restart vLLM calls :meth:`FxrtCompiler.load` with that handle
and the piece, and fxrt loads it from its cache (a hit is a miss that was faster, so a key that
is gone only costs a compile). vLLM's post-grad passes (its Inductor pass manager, in
``compiler_config``) are written for Inductor's graphs and are not run: fxrt's own patterns fuse
the decoder's norms and activations.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from vllm.compilation.compiler_interface import CompilerInterface
from vllm.logger import logger as log


class FxrtCompiler(CompilerInterface):
    """vLLM's ``CompilerInterface`` over fxrt's backend and compile cache."""

    name = "fxrt"

    def __init__(self) -> None:
        self.cache = True

    def initialize_cache(
        self, cache_dir: str, disable_cache: bool = False, prefix: str = ""
    ) -> None:
        # fxrt's compiled pieces live in fxrt's own cache (FXRT_CACHE_DIR), keyed by content:
        # vLLM's directory keeps only the handles. vLLM's "disable cache" turns fxrt's off too.
        self.cache = not disable_cache

    def compute_hash(self, vllm_config: Any) -> str:
        """What changes fxrt's output beyond the graph: fxrt's code and torch (fxrt's cache key
        holds the rest: the graph, its inputs, fxrt's options)."""
        from ..serialize import versions

        return hashlib.sha256(repr(sorted(versions().items())).encode()).hexdigest()[:10]

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        compiler_config: dict[str, Any],
        compile_range: Any,
        key: str | None = None,
    ) -> tuple[Any, Any]:
        fn, cache_key = self._compile(graph, example_inputs)
        return fn, (("fxrt", cache_key) if cache_key is not None else None)

    def load(
        self,
        handle: Any,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        graph_index: int,
        compile_range: Any,
    ) -> Any:
        fn, cache_key = self._compile(graph, example_inputs)
        if cache_key != handle[1]:
            log.info(
                "fxrt: vLLM's piece %d (handle %s) is not in fxrt's cache; it was compiled again",
                graph_index,
                handle[1][:16],
            )
        return fn

    def _compile(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> tuple[Any, Any]:
        from ..backend import backend
        from .graphs import compiled_graph

        fn = backend(graph, example_inputs, options={"cache": self.cache})
        return fn, getattr(compiled_graph(fn), "cache_key", None)
