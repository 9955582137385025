"""fxrt's whole-graph capture behind vLLM's static graph wrapper protocol.

vLLM wraps what it wants captured per batch size in its platform's static graph wrapper
(``current_platform.get_static_graph_wrapper_cls()``, CUDAGraphWrapper on CUDA, vllm-ascend's
ACLGraphWrapper on Ascend): constructed with the runnable, vLLM's config and a runtime mode, and
called inside vLLM's forward context, which says per call whether this wrapper's mode is on and
for which batch descriptor (vLLM pads each batch to one of its capture sizes).

:class:`FxrtGraphWrapper` is that wrapper for a runnable fxrt compiled (a piece from
:class:`fxrt.vllm.compiler.FxrtCompiler`, or the whole graph from fxrt's backend): where the
forward context asks for this mode, the call goes to a twin of the compiled graph with capture
on, which captures the Program into a device graph once per input signature (so once per padded
batch size) and replays it from then on (docs/streams.md); any other call runs the compiled loop.
On a device without graphs (the CPU) capture is accepted and the loop runs. A runnable that is not
fxrt's runs as it is.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def compiled_graph(runnable: Any) -> Any:
    """The :class:`fxrt.CompiledGraph` behind ``runnable`` (fxrt's compiled loop or the graph
    itself), or None."""
    from ..compiler import CompiledGraph

    owner = getattr(runnable, "_owner", runnable)
    return owner if isinstance(owner, CompiledGraph) else None


class FxrtGraphWrapper:
    """vLLM's static graph wrapper over fxrt's capture (see the module docstring).

    Args:
        runnable: what vLLM wraps.
        vllm_config: vLLM's config.
        runtime_mode: the ``CUDAGraphMode`` this wrapper captures for (``FULL`` or ``PIECEWISE``).
        kwargs: vLLM's platform-specific options (its CUDA graph options); not used.

    Attributes:
        captured: the graph that captures (``None`` when the runnable is not fxrt's);
            ``captured.capture_report()`` says what it captured.
        batch_descriptors: the batch descriptors of the calls it took.
    """

    def __init__(self, runnable: Any, vllm_config: Any, runtime_mode: Any, **kwargs: Any) -> None:
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context, is_forward_context_available

        # Imported once here: the call path reads the forward context on every call.
        self._context, self._has_context = get_forward_context, is_forward_context_available
        if runtime_mode == CUDAGraphMode.NONE:
            raise ValueError("fxrt: a static graph wrapper needs a runtime mode other than NONE")
        self.runnable = runnable
        self.vllm_config = vllm_config
        self.runtime_mode = runtime_mode
        self.batch_descriptors: set[Any] = set()
        cg = compiled_graph(runnable)
        self.captured = None if cg is None else _with_capture(cg)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.captured is None or kwargs or not self._has_context():
            return self.runnable(*args, **kwargs)
        context = self._context()
        if context.cudagraph_runtime_mode != self.runtime_mode or context.batch_descriptor is None:
            return self.runnable(*args)
        self.batch_descriptors.add(context.batch_descriptor)
        return self.captured(*args)

    def unwrap(self) -> Any:
        """The runnable, as vLLM's wrappers offer it."""
        return self.runnable.unwrap() if hasattr(self.runnable, "unwrap") else self.runnable

    def clear_graphs(self) -> None:
        """Free the captures and their memory pool (later calls capture again)."""
        if self.captured is not None:
            self.captured.release_memory()


def _with_capture(cg: Any) -> Any:
    """A twin of ``cg`` (the same IR and plan, the program lowered again) with capture on."""
    config = dataclasses.replace(cg.config, capture=True)
    return type(cg)._rebuilt(cg.graph, cg.plan, list(cg.pass_records), config)
