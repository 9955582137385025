"""The ``torch.compile`` entry: ``torch.compile(model, backend="fxrt")``.

Dynamo hands over a Torch-level FX graph. Two paths lower it to ATen:

* Inference (no input requires grad, or grad mode is off; Dynamo guards on grad mode, so this
  holds for every call of the graph): fxrt traces the graph to ATen itself with ``make_fx`` on
  Dynamo's fake inputs, without functionalization. In-place ops and views stay what they are in
  eager, so input mutation and outputs that alias inputs behave exactly as in eager with no runtime
  wrapper at all, and the compiled graph is what Dynamo calls. The lifetime planner already
  understands in-place ops and views.
* Training (some input requires grad and grad mode is on) and tensor subclasses: AOTAutograd
  (functionalized, input mutations kept in the graph as ``copy_``) partitions forward and backward,
  and fxrt compiles both graphs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from .compiler import get_compiler
from .config import CompilerConfig

log = logging.getLogger("fxrt")


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
    config = CompilerConfig.from_options(mode, options)
    _install_serializable()
    if is_inference(example_inputs):
        cg = _compile_inference(gm, example_inputs, config)
        _record_for_caching_precompile(gm, cg)
        return cg.entry(static_inputs(example_inputs))
    if _in_aot_compile():
        raise RuntimeError(
            "fxrt: aot_compile / save_compiled_function holds inference graphs only, and this "
            "graph needs autograd (an input requires grad and grad mode is on). Compile it under "
            "torch.no_grad() (or with inputs that do not require grad), or use "
            "backend='aot_eager' or 'inductor' for a training graph."
        )

    from torch._dynamo.backends.common import aot_autograd

    compiler = get_compiler(config)
    return aot_autograd(
        fw_compiler=compiler, bw_compiler=compiler, keep_inference_input_mutations=True
    )(gm, example_inputs)


def static_inputs(example_inputs: Sequence[Any]) -> list[int]:
    """The positions of the inputs Dynamo passes as static: parameters and buffers (and tensors
    marked with ``torch._dynamo.mark_static_address``)."""
    return [
        i
        for i, x in enumerate(example_inputs)
        if isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None)
    ]


def _compile_inference(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: CompilerConfig
) -> Callable[..., Any]:
    """Trace to ATen and compile, through the cache keyed on Dynamo's graph itself, so that a hit
    skips the ATen trace too.

    A graph with symbolic sizes is keyed with the facts of Dynamo's shape environment, and its
    entry holds the guards the trace added; a hit whose guards hold for these sizes adds them
    again (:mod:`fxrt.shapefacts`). One whose facts cannot be keyed (sizes that depend on data)
    is compiled without the cache.
    """
    from . import cache
    from .cache.lookup import cached_compile
    from .compiler import CompiledGraph, _compile
    from .ir import ValueKind, from_fx
    from .shapefacts import ShapeFacts

    # Dynamo restarts with the floats the graph reads specialized, before anything is looked up
    # or traced (where it can restart).
    _specialize_float_inputs(gm)
    key_graph = from_fx(gm, example_inputs)
    static = all(
        v.kind is not ValueKind.SYM and (v.meta is None or v.meta.is_static)
        for v in key_graph.values
    )

    def build() -> Any:
        aten, fake_inputs = trace_to_aten(gm, example_inputs)
        return _compile(aten, fake_inputs, config, owned_constants=True)

    rebuild = CompiledGraph._rebuilt

    if static:
        return cached_compile(
            key_graph, example_inputs, config, build, gm, rebuild=rebuild, level="dynamo"
        )
    if not config.cache:
        return build()
    try:
        shapes = ShapeFacts.of(example_inputs)
    except cache.Unkeyable as e:
        cache.stats["uncached"] += 1
        log.debug("fxrt cache: not caching %s: %s", cache.graph_name(key_graph), e)
        return build()
    # The inputs as Dynamo traced them: sizes by symbol, not this call's numbers.
    fakes = [n.meta.get("example_value", x) for n, x in zip(_placeholders(gm), example_inputs)]
    return cached_compile(
        key_graph, fakes, config, build, gm, rebuild=rebuild, level="dynamo", shapes=shapes
    )


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _in_aot_compile() -> bool:
    """Whether Dynamo's ``aot_compile`` is calling the backend: it turns on AOTAutograd's
    bundled, strict cache for the call, which nothing else does."""
    cfg = torch._functorch.config
    return bool(
        cfg.bundled_autograd_cache and cfg.strict_autograd_cache and cfg.force_autograd_cache
    )


def is_inference(example_inputs: Sequence[Any]) -> bool:
    """True when no autograd graph can be needed and no input is a tensor subclass."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if any(is_traceable_wrapper_subclass(t) for t in tensors):
        return False
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def trace_to_aten(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
) -> tuple[torch.fx.GraphModule, list[Any]]:
    """Trace a Dynamo graph to an ATen-level graph (not functionalized) on its fake inputs;
    return it with the fake inputs it was traced on.

    Node metadata (``stack_trace`` in particular) carries over from ``gm``'s nodes, so errors name
    the user's source line.
    """
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    fake_mode = torch._guards.detect_fake_mode(example_inputs) or FakeTensorMode()
    context = torch._guards.TracingContext.try_get()

    def fakify(x: Any) -> Any:
        # Dynamo passes real tensors. Reuse the symbolic context Dynamo gave each one, so its
        # dynamic sizes keep their symbols and guard sources; a tensor Dynamo never fakified
        # (a parameter or buffer) gets static shapes, as in AOTAutograd.
        if not isinstance(x, torch.Tensor) or isinstance(x, FakeTensor):
            return x
        if context is not None and x in context.tensor_to_context:
            sym_ctx = context.tensor_to_context[x]
            return fake_mode.from_tensor(
                x, symbolic_context=sym_ctx, source=sym_ctx.tensor_source, trace=False
            )
        return fake_mode.from_tensor(x, static_shapes=True)

    # Prefer the fakes Dynamo itself traced with (placeholder metadata): they carry its symbols
    # and memos, e.g. the SymFloat behind a scalar tensor Dynamo reads with .item().
    dynamo_fakes = [n.meta.get("example_value", n.meta.get("val")) for n in _placeholders(gm)]
    inputs = [
        f if isinstance(f, FakeTensor) and f.fake_mode is fake_mode else fakify(x)
        for f, x in zip(dynamo_fakes, example_inputs)
    ]
    _specialize_float_inputs(gm)
    interpreter = torch.fx.Interpreter(gm)
    # The Python dispatcher, as in AOTAutograd: symbolic-size-aware decompositions and metas.
    with fx_traceback.preserve_node_meta(), fake_mode, enable_python_dispatcher():
        aten = make_fx(interpreter.run, tracing_mode="fake", pre_dispatch=False)(*inputs)
    return aten, inputs


def _specialize_float_inputs(gm: torch.fx.GraphModule) -> None:
    """Ask Dynamo to restart with the float inputs the graph reads specialized, where it can.

    Under ``dynamic=True`` Dynamo turns Python floats (LayerNorm's ``eps``) into scalar tensors
    read back with ``.item()``; AOTAutograd rewrites those reads into tensor arithmetic and asks
    Dynamo to specialize the ones it cannot. fxrt specializes every float the graph reads: Dynamo
    then bakes each in as a constant, guarded, and restarts the analysis, so fused patterns see
    constants.

    Dynamo gives every 0-d float or integer tensor input such a memo, read or not; an input the
    graph uses only as a tensor (a serving engine's 0-d handle tensors) is left alone. Where
    the caller cannot restart (``aot_compile``, which PyTorch's precompile and serving engines
    use), nothing is asked: a read whose value Dynamo's trace already pinned with a guard is
    folded in, as the restart would have (:func:`_fold_guarded_reads`), and one still symbolic
    stays a symbolic float, which the trace and both loops handle.
    """
    names = _floats_read(gm)
    if not names:
        return
    if _in_aot_compile():
        _fold_guarded_reads(gm)
        return
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._dynamo.symbolic_convert import TensorifyState

    restart = False
    for name in names:
        if not TensorifyState.should_specialize(name):
            TensorifyState.specialize(name)
            restart = True
    if restart:
        raise TensorifyScalarRestartAnalysis


def _floats_read(gm: torch.fx.GraphModule) -> list[str]:
    """The symbols of the scalar memos of ``gm``'s inputs that the graph reads with ``.item()``."""
    names = []
    for n in _placeholders(gm):
        name = _memo_name(n)
        if name is not None and any(_reads_item(u) for u in n.users):
            names.append(name)
    return names


def _fold_guarded_reads(gm: torch.fx.GraphModule) -> None:
    """Replace each ``.item()`` read whose value Dynamo's trace already pinned with a guard (the
    shape environment maps its symbol to a number: LayerNorm's ``eps``) by that number, as the
    restart would have. A read still symbolic stays a read."""
    import sympy

    for n in _placeholders(gm):
        value, memo = _memo(n)
        expr = getattr(getattr(memo, "node", None), "expr", None)
        if not isinstance(expr, sympy.Number):
            continue
        number = float(expr) if value.dtype.is_floating_point else int(expr)
        for user in [u for u in n.users if _reads_item(u)]:
            user.replace_all_uses_with(number)
            gm.graph.erase_node(user)
    gm.recompile()


def _memo(placeholder: torch.fx.Node) -> tuple[Any, Any]:
    """The input's example value as Dynamo traced it, and its ``.item()`` memo (or None)."""
    value = placeholder.meta.get("example_value", placeholder.meta.get("val"))
    return value, getattr(value, "item_memo", None)


def _memo_name(placeholder: torch.fx.Node) -> str | None:
    memo = _memo(placeholder)[1]
    return getattr(getattr(getattr(memo, "node", None), "_expr", None), "name", None)


def _reads_item(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "item"
    return node.op == "call_function" and node.target in (
        torch.Tensor.item,
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.item.default,
    )


# ----------------------------------------------------------------------------------------------
# PyTorch's precompile (the data format is fxrt.precompile's)


def _install_serializable() -> None:
    """Make :class:`fxrt.CompiledGraph` and the compiled loop ``SerializableCallable``s (called
    when Dynamo runs the backend, so importing fxrt never imports Dynamo)."""
    from torch._dynamo.aot_compile_types import SerializableCallable

    from .compiler import CompiledGraph, GraphLoop

    for cls in (CompiledGraph, GraphLoop):  # what the backend returns (CompiledGraph.entry)
        if not issubclass(cls, SerializableCallable):
            SerializableCallable.register(cls)


def _record_for_caching_precompile(gm: Any, cg: Any) -> None:
    """Under ``TORCH_CACHING_PRECOMPILE=1``, hand Dynamo the bytes of ``cg`` for the graph
    ``gm`` (Dynamo's package keeps them with its guards). A graph the format cannot hold is
    left to Dynamo, which compiles it again in the next process."""
    import torch._dynamo.config

    backend_id = getattr(gm, "_backend_id", None)
    if not torch._dynamo.config.caching_precompile or backend_id is None:
        return
    from torch._dynamo.precompile_context import PrecompileContext

    from .precompile import serialize
    from .serialize import SerializationError

    try:
        data = serialize(cg)
    except SerializationError:
        return
    PrecompileContext.record_artifact(_artifact_class()(backend_id, data))


_ARTIFACT: type | None = None


def _artifact_class() -> type:
    """:class:`FxrtArtifact`, defined on first use (its base class is Dynamo's)."""
    global _ARTIFACT
    if _ARTIFACT is None:
        from torch._dynamo.precompile_context import BackendCacheArtifact

        @dataclasses.dataclass
        class FxrtArtifact(BackendCacheArtifact):  # type: ignore[misc]
            """An fxrt graph in Dynamo's caching precompile: ``content`` is its bytes."""

            def after_deserialization(self) -> Any:
                from .compiler import CompiledGraph

                return CompiledGraph.deserialize_compile_artifacts(self.content).entry()

        FxrtArtifact.__module__ = __name__
        FxrtArtifact.__qualname__ = "FxrtArtifact"
        _ARTIFACT = FxrtArtifact
    return _ARTIFACT


def __getattr__(name: str) -> Any:
    # ``fxrt.backend.FxrtArtifact`` resolves (Dynamo's package pickles the class by name).
    if name == "FxrtArtifact":
        return _artifact_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
