"""fxrt: a fast graph runtime for PyTorch inference.

Use it as a ``torch.compile`` backend::

    compiled = torch.compile(model, backend="fxrt")

or compile an ATen-level FX graph directly with :func:`compile_graph`.
"""

from .backend import backend
from .compiler import CompiledGraph, compile_graph, get_compiler
from .config import CompilerConfig
from .errors import ExecutionError
from .inductor import (
    get_fused_kernel_payload,
    register_fused_kernel,
    register_fx_wrapper,
    unregister_fx_wrapper,
)
from .ops.kernels import load_kernel_library, register_kernel, unregister_kernel
from .profiler import Profile, profile
from .runtime import runtime_info

__version__ = "0.1.0"

__all__ = [
    "CompiledGraph",
    "CompilerConfig",
    "ExecutionError",
    "Profile",
    "backend",
    "compile_graph",
    "get_compiler",
    "profile",
    "get_fused_kernel_payload",
    "load_kernel_library",
    "register_kernel",
    "register_fused_kernel",
    "register_fx_wrapper",
    "runtime_info",
    "unregister_fx_wrapper",
    "unregister_kernel",
    "__version__",
]
