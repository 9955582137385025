"""fxrt as the executor of Inductor's FX host wrapper (``torch._inductor.config.fx_wrapper``).

Inductor normally emits its host wrapper as Python source. With ``fx_wrapper = True`` it builds
the wrapper as an FX graph instead (``WrapperFxCodegen``, torch/_inductor/codegen/wrapper_fxir.py)
and calls ``compile_graph(gm)`` on the wrapper codegen class registered for the device to turn it
into a callable. Upstream accepts only Triton kernels in that graph, so on CPU, whose kernels are
C++, it fails with "FX conversion only supports Triton kernels".

:class:`FxrtWrapperCodegen` subclasses ``WrapperFxCodegen`` and changes two things:

* kernels: its converter (:class:`HostGraphConverter`) keeps every non-Triton kernel call in the
  host graph as a plain call of the kernel's Python callable with the kernel's arguments (buffers
  become the FX values holding them, size symbols the nodes computing them), which is how
  Inductor's Python wrapper calls CPU kernels. On the CPU the callable comes from, in order: the
  wrapper's definition of the kernel (loaded as the Python wrapper would load it, e.g.
  ``async_compile.cpp_pybinding(...)`` for C++ kernels), a name the wrapper's header defines, or a
  callable payload a device library registered with :func:`fxrt.inductor.register_fused_kernel`.
  On other devices, where the Python wrapper passes non-Triton kernels device-specific arguments
  (a CUDA stream), only a registered callable is used. Definitions still compiling in the
  background are resolved after the whole graph is built, so kernels compile in parallel as in
  the Python wrapper. Triton kernels go through the upstream conversion
  (``triton_kernel_wrapper_mutation``). Two smaller gaps of the upstream converter are closed on
  the way: kernels inside a ``torch.cond`` branch do nothing on the fake tensors the parent graph
  traces the branch with, and the ``assert_alignment`` checks such code writes as plain source
  lines become calls.
* execution: ``compile_graph`` hands the host graph to fxrt (:mod:`fxrt.inductor.host_graph`),
  which runs allocations, views and extern ATen calls natively, on the compiled C++ loop or the
  Python one (``CompilerConfig.pure_python``). A C++ kernel's call targets a
  :class:`~fxrt.ops.c_kernels.CKernel`: the compiled loop calls its C function directly with the
  data pointers and sizes its binding would pass (a KERNEL instruction), the Python loop its
  binding. Other kernels are Python calls (PYCALL).

Where a graph's wrapper cannot run on fxrt (a line the converter does not know, a graph fxrt fails
to compile), that graph gets Inductor's own Python wrapper instead, with one warning on the
``fxrt`` logger naming the graph and the reason; ``stats["python_wrapper_fallbacks"]`` counts
them. The Python wrapper is generated from the same wrapper lines, kept as they were before the
FX conversion planned them (the class also writes the Python wrapper's input-size prologue, which
the FX path ignores). Two cases stay errors: a kernel with no runnable definition at all
(:class:`MissingKernelError`: Inductor's own wrapper could not call it either), and a graph with
``torch.cond`` subgraphs, whose wrapper lines exist only in FX form; there the error is raised
as before. Ahead-of-time compilation and subgraphs are never redirected.

:func:`register_fx_wrapper` installs the class as the ``fx_wrapper_codegen`` of Inductor's cpu and
cuda backends (the rest of each ``DeviceCodegen`` entry, and the device's custom passes and config,
are left as they are) and sets ``fx_wrapper = True``; :func:`unregister_fx_wrapper` puts back the
exact entries and config value found. Both are idempotent. Without registration Inductor is
untouched, and a user who sets ``fx_wrapper = True`` alone gets the upstream implementation.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.fx
from torch._C._dynamo.guards import assert_alignment
from torch._inductor import config as inductor_config
from torch._inductor.codecache import CodeCacheFuture, PyCodeCache
from torch._inductor.codegen import common as inductor_common
from torch._inductor.codegen.common import FileBackedGraphModule
from torch._inductor.codegen.wrapper import (
    KernelCallLine,
    KernelDefinitionLine,
    PythonWrapperCodegen,
    WrapperLine,
)
from torch._inductor.codegen.wrapper_fxir import FxConverter, TritonKernel, WrapperFxCodegen
from torch._inductor.runtime.triton_heuristics import CachingAutotuner
from torch._inductor.virtualized import V
from torch._library.triton import wrap_triton
from torch._subclasses.fake_tensor import is_fake

from ..compiler import CompiledGraph
from ..config import CompilerConfig
from ..ops.c_kernels import CKernel
from .fused_kernels import get_fused_kernel_payload
from .host_graph import compile_host_graph, stats

DEVICES = ("cpu", "cuda")
log = logging.getLogger("fxrt")


class MissingKernelError(RuntimeError):
    """A non-Triton kernel of the host graph has no runnable definition: neither the wrapper nor
    a device library (:func:`fxrt.register_fused_kernel`) provides one. Inductor's own wrapper
    could not call it either, so this is raised rather than falling back to it."""


class _UnresolvedKernel:
    """Stand-in target of a kernel call until its definition has finished compiling."""

    def __init__(self, name: str):
        self.__name__ = self.__qualname__ = name

    def __call__(self, *args: Any) -> None:
        raise RuntimeError(f"fxrt: kernel {self.__name__!r} was never resolved")


def _named_callable(name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` itself if it has a ``__name__`` (FX's code generation needs one to name a call
    target), else a function of that name calling it (one Python frame more per call)."""
    if isinstance(getattr(kernel, "__name__", None), str):
        return kernel

    def call(*args: Any) -> Any:
        return kernel(*args)

    call.__name__ = call.__qualname__ = name
    return call


def _skipping_fake(name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        if any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
            return None
        return kernel(*args)

    call.__name__ = call.__qualname__ = name
    return call


@dataclasses.dataclass
class RuntimeAssertLine(WrapperLine):
    """A check some codegen paths (``torch.cond`` outputs) write as a plain source line, such as
    ``assert_alignment(buf3, 16, 'torch.ops.cond')``, which the upstream converter rejects."""

    text: str

    @staticmethod
    def wrap(line: Any) -> Any:
        if isinstance(line, str) and line.lstrip().startswith(
            ("assert_alignment(", "assert_size_stride(")
        ):
            return RuntimeAssertLine(line.strip())
        return line

    def codegen_fx(self, converter: FxConverter) -> Callable[[Any], None]:
        return converter._generate_runtime_assert


def _comment(line: Any) -> bool:
    """A plain source line that is a comment or blank (``# buffer buf9 (op: ...) is assumed to
    be not aligned``): it runs nothing, and the upstream converter rejects it."""
    return isinstance(line, str) and (not line.strip() or line.lstrip().startswith("#"))


class HostGraphConverter(FxConverter):
    """``FxConverter`` that keeps non-Triton kernel calls in the host graph (see the module
    docstring) instead of rejecting them."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # kernel name -> its callable, or a future of it while it compiles in the background
        self.host_kernels: dict[str, Any] = {}
        self.kernel_calls: list[tuple[torch.fx.Node, str, str]] = []  # node, kernel, device
        self.cpp_kernels: set[str] = set()  # kernels defined by async_compile.cpp_pybinding
        self._prologue_module: Any = None

    def _load_definition(self, line: KernelDefinitionLine) -> Any:
        # Exactly what upstream's _import_kernel evaluates, minus its Triton-only type check.
        code = PythonWrapperCodegen._format_kernel_definition(
            line.kernel_name, line.kernel_body, metadata=line.metadata
        )
        return getattr(PyCodeCache.load("\n".join([self.prologue, code])), line.kernel_name)

    def _register_triton(self, name: str, tuner: CachingAutotuner) -> None:
        tuner._ensure_kernel_loaded()  # as upstream: reload what parallel compile stripped
        self.kernels[name] = TritonKernel(tuner, wrap_triton(tuner.fn))

    def _generate_kernel_definition(self, line: KernelDefinitionLine) -> None:
        if line.kernel_body.lstrip().startswith("async_compile.cpp_pybinding("):
            self.cpp_kernels.add(line.kernel_name)
        kernel = self._load_definition(line)
        if isinstance(kernel, CachingAutotuner):
            self._register_triton(line.kernel_name, kernel)
        else:
            # A host kernel, or a future whose kind the first call line will tell.
            self.host_kernels[line.kernel_name] = kernel

    def _generate_kernel_call(self, line: KernelCallLine) -> None:
        name = line.kernel_name
        if line.triton:
            if name not in self.kernels and name in self.host_kernels:
                kernel = self.host_kernels.pop(name)
                if isinstance(kernel, CodeCacheFuture):
                    kernel = kernel.result()
                if not isinstance(kernel, CachingAutotuner):
                    raise NotImplementedError(
                        f"fxrt: kernel {name!r} is called as a Triton kernel but its definition "
                        f"gave {type(kernel).__name__}"
                    )
                self._register_triton(name, kernel)
            super()._generate_kernel_call(line)
            return
        args = tuple(self._host_kernel_arg(a) for a in line.call_args)
        node = self._call_without_hooks(_UnresolvedKernel(name), args, name)
        node.meta["fxrt_kernel"] = name
        if name in self.cpp_kernels and line.arg_types and len(line.arg_types) == len(args):
            # A C++ kernel reads only the data pointer of a tensor passed for a ``T*``
            # parameter, never its sizes or strides (fxrt.passes.host_graph.simplify_views relies
            # on it).
            node.meta["fxrt_pointer_args"] = tuple(
                i for i, t in enumerate(line.arg_types) if str(t).rstrip().endswith("*")
            )
            node.meta["fxrt_arg_types"] = tuple(str(t) for t in line.arg_types)
        self.kernel_calls.append((node, name, line.device.type))

    def _call_without_hooks(self, target: Any, args: tuple[Any, ...], name: str) -> torch.fx.Node:
        # Upstream's metadata hook would run the target on fake tensors to fill meta["val"];
        # compiled kernels and runtime checks read real data, so create the node without hooks.
        # Both return nothing: a kernel's results are the buffers it writes.
        hooks, self.gm._create_node_hooks = self.gm._create_node_hooks, []
        try:
            node = self.gm.graph.create_node("call_function", target, args, {}, name=name)
        finally:
            self.gm._create_node_hooks = hooks
        node.meta["val"] = None
        return node

    def _generate_runtime_assert(self, line: RuntimeAssertLine) -> None:
        """``assert_alignment(buf, n, op)`` becomes a call of the same check on the buffer's
        value; ``assert_size_stride`` is dropped, as upstream drops its structured form."""
        call = ast.parse(line.text, mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
            raise NotImplementedError(f"fxrt: unrecognized wrapper line {line.text!r}")
        if call.func.id != "assert_alignment":
            return
        buf, *rest = call.args
        if not (isinstance(buf, ast.Name) and buf.id in self.buffer_to_node):
            raise NotImplementedError(f"fxrt: unrecognized wrapper line {line.text!r}")
        args = (self.buffer_to_node[buf.id], *(ast.literal_eval(a) for a in rest))
        self._call_without_hooks(assert_alignment, args, "assert_alignment")

    def _host_kernel_arg(self, arg: Any) -> Any:
        """The FX value for one of a kernel call's arguments (a buffer or a size)."""
        if isinstance(arg, str):
            if arg in self.buffer_to_node:
                return self.buffer_to_node[arg]
            return self._size_node(arg)
        if isinstance(arg, sympy.Expr):
            return self._generate_sym_node(arg)
        return arg

    def _size_node(self, name: str) -> Any:
        # Size arguments are printed sympy symbols: an input size (s0), an unbacked one (u0) or a
        # precomputed expression (ks0) whose definition the sizevars keep.
        for expr in self.expr_to_proxy:
            if isinstance(expr, sympy.Symbol) and expr.name == name:
                return self.expr_to_proxy[expr].node
        for sym, expr in V.graph.sizevars.inv_precomputed_replacements.items():
            if sym.name == name:
                return self._generate_sym_node(expr)
        try:
            return int(name)
        except ValueError:
            pass
        try:
            return self._generate_sym_node(sympy.sympify(name))
        except Exception as e:
            raise NotImplementedError(f"fxrt: cannot resolve kernel argument {name!r}") from e

    def _resolve_kernel(self, name: str, device: str) -> Callable[..., Any]:
        payload = get_fused_kernel_payload(name)
        registered = payload if callable(payload) else None
        if device != "cpu":
            # Outside the CPU, Inductor's Python wrapper calls non-Triton kernels with device
            # specific arguments (CUDA C++ kernels take a stream), so a definition cannot be
            # called as kernel(*args): only a device library's registered callable can.
            if registered is None:
                raise NotImplementedError(
                    f"fxrt: non-Triton kernel {name!r} on {device}: register a callable taking "
                    "the kernel's arguments with fxrt.register_fused_kernel"
                )
            return registered
        kernel = self.host_kernels.get(name)
        if isinstance(kernel, CodeCacheFuture):
            kernel = self.host_kernels[name] = kernel.result()
        if kernel is None:
            if self._prologue_module is None:
                self._prologue_module = PyCodeCache.load(self.prologue)
            kernel = getattr(self._prologue_module, name, None)
        if kernel is None:
            kernel = registered
        if kernel is None or isinstance(kernel, CachingAutotuner) or not callable(kernel):
            raise MissingKernelError(
                f"fxrt: no runnable definition for non-Triton kernel {name!r}: the wrapper does "
                "not define it and no callable payload is registered under that name "
                "(fxrt.register_fused_kernel)"
            )
        return kernel

    def generate(self) -> torch.fx.GraphModule:
        gm = super().generate()
        for node, name, device in self.kernel_calls:
            kernel = self._resolve_kernel(name, device)
            # The parent graph's converter runs a subgraph (a torch.cond branch) on fake tensors
            # to learn its outputs' metadata; a compiled kernel cannot read fake data, and its
            # writes do not change metadata, so on fake arguments it does nothing.
            arg_types = node.meta.get("fxrt_arg_types")
            if self.is_subgraph:
                node.target = _named_callable(name, _skipping_fake(name, kernel))
            elif arg_types is not None and kernel is self.host_kernels.get(name):
                # Its C function, which the compiled loop calls directly (a KERNEL instruction).
                node.target = CKernel(name, kernel, arg_types)
            else:
                node.target = _named_callable(name, kernel)
            payload = get_fused_kernel_payload(name)
            if payload is not None:
                node.meta["fxrt_fused_payload"] = payload
        if self.kernel_calls:
            gm.recompile()
        return gm


def _graph_name() -> str:
    """The graph being compiled as a log line can name it: Dynamo's compile id (``[0/1]``, the
    frame and its recompile) and Inductor's name for subgraphs or graph partitions."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    name = getattr(V.graph, "name", None)
    return " ".join(str(x) for x in (f"[{compile_id}]" if compile_id else None, name) if x) or "?"


class FxrtWrapperCodegen(WrapperFxCodegen):
    """Inductor's FX wrapper codegen with non-Triton kernels kept as host calls, executed by
    fxrt, or Inductor's own Python wrapper for a graph fxrt cannot run (see the module
    docstring). Registered for cpu and cuda by :func:`register_fx_wrapper`."""

    def codegen_inputs(self) -> None:
        # The FX converter binds input sizes itself and ignores the prefix; the Python wrapper a
        # fallback generates needs them bound there, as PythonWrapperCodegen writes them.
        self._python_prefix_ok = False
        if self.is_subgraph:
            return
        try:
            PythonWrapperCodegen.codegen_inputs(self)
        except Exception:  # an input kind the Python prologue does not handle: no fallback
            return
        self._python_prefix_ok = True

    def _generate(self, is_inference: bool) -> Any:
        # Wrapper lines as they are before memory planning, which rewrites them in place (a
        # reused buffer's free line is marked reused): a fallback plans these copies again.
        pristine = [copy.copy(line) for line in self.lines]
        try:
            return self._generate_fx(is_inference)
        except MissingKernelError:
            raise
        except Exception as e:
            if not self._can_fall_back():
                raise
            text = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
            reason = f"{type(e).__name__}: {text}"[:300]
        log.warning(
            "fxrt: Inductor graph %s runs on Inductor's own Python wrapper, not fxrt (%s)",
            _graph_name(),
            reason,
        )
        stats["python_wrapper_fallbacks"] += 1
        self.lines = pristine
        return PythonWrapperCodegen._generate(self, is_inference)

    def _can_fall_back(self) -> bool:
        return (
            not self.is_subgraph
            and not V.aot_compilation
            and not self.subgms
            and getattr(self, "_python_prefix_ok", False)
        )

    def _generate_fx(self, is_inference: bool) -> tuple[FileBackedGraphModule, None]:
        # Upstream's _generate with our converter (upstream builds FxConverter directly).
        self.run_wrapper_ir_passes(is_inference)
        prologue = "\n".join([self.imports.getvalue(), self.header.getvalue()])
        gm = HostGraphConverter(
            lines=[RuntimeAssertLine.wrap(line) for line in self.lines if not _comment(line)],
            prologue=prologue,
            graph_inputs=self.get_fx_graph_inputs(),
            graph_outputs=self.get_graph_outputs(),
            subgms=self.subgms,
            is_subgraph=self.is_subgraph,
        ).generate()
        module = FileBackedGraphModule(gm, self.compile_graph(gm))
        if isinstance(module.compiled_fn, CompiledGraph):
            # Inductor binds ``module.call`` once and calls it with the argument list; a
            # CompiledGraph called with one list takes it as its inputs (AOTAutograd's boxed
            # convention), so Inductor can call it directly, one Python frame and an argument
            # unpacking fewer than FileBackedGraphModule.call's ``compiled_fn(*args)``.
            module.call = module.compiled_fn
        return module, None

    def compile_graph(self, gm: torch.fx.GraphModule) -> Callable[..., Any]:
        """Compile the host graph with fxrt (the loop ``register_fx_wrapper``'s config picks).
        Ahead-of-time compilation returns the graph itself to its caller and never runs this
        callable, so there it stays upstream's."""
        if V.aot_compilation:
            return super().compile_graph(gm)
        cg: CompiledGraph = compile_host_graph(gm, _active_config())
        return cg


@dataclasses.dataclass
class _Registration:
    config: CompilerConfig
    previous_fx_wrapper: bool
    # device -> the DeviceCodegen entry found before ours was installed
    previous: dict[str, inductor_common.DeviceCodegen]
    installed: dict[str, inductor_common.DeviceCodegen]


_lock = threading.RLock()
_state: _Registration | None = None


def _active_config() -> CompilerConfig:
    state = _state
    return state.config if state is not None else CompilerConfig()


def register_fx_wrapper(config: CompilerConfig | None = None) -> None:
    """Make Inductor emit its host wrapper as an FX graph and run it with fxrt.

    Sets ``torch._inductor.config.fx_wrapper = True`` and installs :class:`FxrtWrapperCodegen` as
    the FX wrapper codegen of Inductor's cpu and cuda backends. Graphs compiled afterwards (with
    ``torch.compile`` and Inductor's defaults otherwise) run their host code in fxrt; Inductor's
    kernels are unchanged. Calling it again only replaces the config.

    Args:
        config: fxrt options for the host graphs; ``pure_python`` picks the Python loop.
            Defaults to ``CompilerConfig()`` (environment-driven).
    """
    global _state
    inductor_common.init_backend_registration()
    with _lock:
        config = config or CompilerConfig()
        if _state is None:
            _state = _Registration(config, inductor_config.fx_wrapper, {}, {})
        _state.config = config
        for device in DEVICES:
            current = inductor_common.device_codegens.get(device)
            if current is None or current is _state.installed.get(device):
                continue
            # First registration, or someone re-registered the device since: remember what is
            # there now and install over it.
            ours = dataclasses.replace(current, fx_wrapper_codegen=FxrtWrapperCodegen)
            inductor_common.device_codegens[device] = ours
            _state.previous[device] = current
            _state.installed[device] = ours
        inductor_config.fx_wrapper = True


def unregister_fx_wrapper() -> None:
    """Undo :func:`register_fx_wrapper`: restore the wrapper codegen entries and the
    ``fx_wrapper`` value found when it was first called. No-op if not registered."""
    global _state
    with _lock:
        state = _state
        if state is None:
            return
        for device, previous in state.previous.items():
            current = inductor_common.device_codegens.get(device)
            if current is state.installed[device]:
                inductor_common.device_codegens[device] = previous
            elif current is not None and current.fx_wrapper_codegen is FxrtWrapperCodegen:
                # Re-registered since with our class copied along: take only ours out.
                inductor_common.device_codegens[device] = dataclasses.replace(
                    current, fx_wrapper_codegen=previous.fx_wrapper_codegen
                )
        inductor_config.fx_wrapper = state.previous_fx_wrapper
        _state = None


def is_registered() -> bool:
    """Whether :func:`register_fx_wrapper` is in effect."""
    return _state is not None


__all__ = [
    "DEVICES",
    "FxrtWrapperCodegen",
    "HostGraphConverter",
    "MissingKernelError",
    "is_registered",
    "register_fx_wrapper",
    "unregister_fx_wrapper",
]
