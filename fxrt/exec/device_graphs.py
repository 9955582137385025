"""Device graph APIs behind whole-graph capture (:mod:`fxrt.exec.capture`), one adapter for all.

CUDA (``torch.cuda.CUDAGraph``), Ascend (``torch.npu.NPUGraph``, through ``torch_npu``, imported
only when an NPU tensor is seen) and any PrivateUse1 device whose module offers the same names
(fxrt's tests use such a stand-in device) share one interface: a graph class with
``replay()`` and ``reset()``, ``graph_pool_handle()``, a ``graph(g, pool=, stream=)`` context
manager that captures the block on ``stream`` (after it waits for the current stream) into
``g``, and a ``Stream`` class. :func:`graph_api` finds them by name on ``torch.<device type>``.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

_GRAPH_CLASSES = ("CUDAGraph", "NPUGraph", "Graph")


@dataclass(frozen=True)
class GraphAPI:
    """One device type's graph API."""

    device_type: str
    module: ModuleType
    graph_class: type

    def new_graph(self) -> Any:
        return self.graph_class()

    def pool_handle(self) -> Any:
        return self.module.graph_pool_handle()

    def new_stream(self, device: torch.device) -> Any:
        return self.module.Stream(device=device)

    def capture(self, graph: Any, pool: Any, stream: Any) -> contextlib.AbstractContextManager:
        return self.module.graph(graph, pool=pool, stream=stream)

    def is_capturing(self, device: torch.device) -> bool:
        probe = getattr(self.module, "is_current_stream_capturing", None)
        if probe is None:
            return False
        try:
            return bool(probe(device))
        except TypeError:
            return bool(probe())


_apis: dict[str, GraphAPI | str] = {}


def graph_api(device_type: str) -> GraphAPI | str:
    """The graph API of ``device_type``, or why it has none (a sentence)."""
    found = _apis.get(device_type)
    if found is None:
        found = _apis[device_type] = _find(device_type)
    return found


def _find(device_type: str) -> GraphAPI | str:
    if device_type == "cpu":
        return "the CPU has no device graphs (reduce-overhead runs the loop there)"
    if device_type == "npu" and not hasattr(torch, "npu"):
        try:
            importlib.import_module("torch_npu")
        except Exception as e:  # torch_npu without CANN fails in many ways
            return f"torch_npu does not import ({type(e).__name__}: {e})"
    module = getattr(torch, device_type, None)
    if module is None:
        return f"torch has no module for device type {device_type!r}"
    cls = next((getattr(module, n) for n in _GRAPH_CLASSES if hasattr(module, n)), None)
    missing = [n for n in ("graph", "graph_pool_handle", "Stream") if not hasattr(module, n)]
    if cls is None or missing:
        return (
            f"torch.{device_type} has no device graph API "
            f"(needs one of {', '.join(_GRAPH_CLASSES)}, graph, graph_pool_handle, Stream)"
        )
    return GraphAPI(device_type, module, cls)


__all__ = ["GraphAPI", "graph_api"]
