"""``compile_graph``: an FX GraphModule through the compile cache and the compile pipeline
(:mod:`fxrt.pipeline`: user pre pass, conversion, overrides, passes, user post pass, own ops,
lifetime plan, arena, lowering) to a :class:`CompiledGraph`, the executor of the Program."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from . import profiler
from .cache import stats as cache_stats
from .config import CompilerConfig
from .exec.capture_report import CaptureReport
from .exec.interp import PythonLoop
from .exec.native import NativeLoop, native_available
from .exec.plan import Plan, plan_lifetimes
from .exec.program import Program
from .exec.streams import node_stream_labels
from .ir import Graph, from_fx, graph_to_text
from .modes import gc_paused, outside_inference_mode
from .records import PassRecord
from .serialize import dump_graph, load_graph
from .stage import lower_program

if TYPE_CHECKING:
    from .exec.capture import CaptureRunner

log = logging.getLogger("fxrt")

_graph_ids = itertools.count()
_profiling = profiler._active  # non-empty while an fxrt.profile() block is open


class CompiledGraph:
    """A compiled graph: call it with the graph's flat inputs.

    ``cg(x, y)`` takes the inputs as arguments. Called with one list, ``cg([x, y])``, it follows
    AOTAutograd's boxed convention, so a CompiledGraph can be returned from an AOTAutograd
    ``fw_compiler`` as it is. Graph inputs are tensors, scalars, SymInts or None, never lists, so
    the two forms cannot be confused.

    Attributes:
        graph: the fxrt IR (``print(cg.graph_text())`` to read it).
        plan: the lifetime plan (FREE positions, predicted peak bytes).
        program: the flat Program the loop runs; ``print(cg.program)`` lists it, each
            instruction with its kind.
        executor: the name of the loop that runs it: ``"python"`` or ``"cpp"``.
        pass_records: one ``PassRecord(name, seconds, changed)`` per built-in pass that ran.
        stage_records: one ``PassRecord`` per compile-pipeline stage that ran in this process
            (:data:`fxrt.pipeline.PIPELINE`, built-in passes included); empty for a graph loaded
            from an artifact or the cache.
        cache_key: the key of this graph's entry in the compile cache, where it was stored in or
            loaded from one (``None`` otherwise): a serving engine keeps it as its handle.
    """

    cache_key: str | None = None

    def __init__(self, graph: Graph, plan: Plan, program: Program, config: CompilerConfig):
        # An instance attribute, not a class one: torch's wrappers (``functools.wraps``) copy the
        # instance ``__dict__``, and AOTAutograd reads the flag from the wrapper.
        self._boxed_call = True
        self.graph = graph
        self.plan = plan
        self.config = config
        idle = config.arena_max_idle
        with outside_inference_mode():  # the tensors binding makes serve every later call
            if config.pure_python or not native_available():
                self._loop: PythonLoop | NativeLoop = PythonLoop(program, arena_max_idle=idle)
            else:
                self._loop = GraphLoop(program, arena_max_idle=idle)
        self.program = self._loop.program  # with the compiled loop's demotions, if any
        self.executor: str = self._loop.name
        self.pass_records: list[PassRecord] = []
        self.stage_records: list[PassRecord] = []
        self.name = f"graph{next(_graph_ids)}"  # names this graph in profiles and traces
        self._capture: CaptureRunner | None = None
        if config.capture_enabled:
            # Imported here: a graph that does not capture (every CPU graph, every load) never
            # needs the capture machinery.
            from .exec.capture import CaptureRunner
            from .exec.native import NativeReplayIndex
            from .exec.replays import ReplayIndex

            loop_class = type(self._loop)
            self._capture = CaptureRunner(
                self.name,
                graph,
                self.program,
                config,
                self._loop,
                # Captures allocate their arena in the graph pool and keep none between calls.
                lambda: loop_class(self.program, arena_max_idle=0),
                lambda sub, capture: _region_graph(sub, config, capture),
                # The compiled loop's replays run in C++ too; the Python loop's are its twin's.
                NativeReplayIndex if isinstance(self._loop, NativeLoop) else ReplayIndex,
            )

    def __call__(self, *args: Any) -> Any:
        inputs = args[0] if len(args) == 1 and type(args[0]) is list else args
        if (_profiling and profiler.active()) or torch.autograd.profiler._is_profiler_enabled:
            return self._run_instrumented(inputs)
        if self._capture is not None:
            return self._capture(inputs)
        return self._loop.run(inputs)

    def entry(self, static_inputs: Sequence[int] = ()) -> Callable[..., Any]:
        """What ``torch.compile`` calls: the compiled loop itself, so a call runs no Python frame
        of fxrt's (it hands calls to this graph while a profiler is on), or this graph when it
        captures or runs on the Python loop.

        Args:
            static_inputs: the positions of inputs that are parameters or buffers: the loop
                keeps their tensors between calls (see :meth:`NativeLoop.keep_inputs`).
        """
        if self._capture is not None or not isinstance(self._loop, NativeLoop):
            return self
        self._loop.keep_inputs(list(static_inputs))
        self._loop._owner = self
        self._loop._boxed_call = True
        return self._loop

    def _run_instrumented(self, inputs: Any) -> Any:
        """One call through the loop's timed variant, recorded in the active fxrt.profile()."""
        torch_ranges = torch.autograd.profiler._is_profiler_enabled
        names = tuple(n.name for n in self.program.nodes) if torch_ranges else None
        t0 = time.perf_counter_ns()
        out, timings = self._loop.run_timed(inputs, names)
        t1 = time.perf_counter_ns()
        prof = profiler.active()
        if prof is not None:
            nodes = self.program.nodes
            prof.calls.append(profiler.CallEvent(self.name, self.executor, t0, t1))
            streams = node_stream_labels(self.program)
            prof.nodes.extend(
                profiler.NodeEvent(self.name, nodes[i].name, nodes[i].op, a, b, streams.get(i))
                for i, a, b in timings
            )
        return out

    def release_memory(self) -> None:
        """Free the arenas this graph keeps between calls (see ``arena_max_idle``) and, with
        capture on, its device graphs and their pool; the next call allocates (or captures)
        again."""
        self._loop.release_memory()
        if self._capture is not None:
            self._capture.release()

    def capture_report(self) -> CaptureReport:
        """What whole-graph capture (``mode="reduce-overhead"``) did: per input signature,
        whether it was captured, its captures and replays, and, for what runs the loop, why
        (naming the node or input). ``print()`` it."""
        if self._capture is None:
            return CaptureReport(self.name, False)
        return self._capture.report()

    def dump_artifacts(self) -> bytes:
        """A self-contained, data-only artifact: the IR, the constants the graph owns, the pass
        records, and the fxrt and torch versions (see :mod:`fxrt.serialize`).
        :meth:`load_artifacts` rebuilds the graph from it.

        Raises:
            SerializationError: the graph holds something the format cannot name (a higher-order
                op with Python subgraphs, a Python callable other than pure arithmetic).
        """
        return dump_graph(self.graph, self.pass_records)

    @classmethod
    def load_artifacts(cls, artifact: bytes, config: CompilerConfig | None = None) -> CompiledGraph:
        """Rebuild a runnable graph from :meth:`dump_artifacts` bytes without compiling. Loads
        data only and validates all of it; the plan and program are recomputed.

        Raises:
            SerializationError: not an fxrt artifact, damaged, invalid, or made by another
                fxrt/torch.
        """
        with gc_paused(), outside_inference_mode():
            graph, plan, records = load_graph(artifact)
            return cls._rebuilt(graph, plan, records, config or CompilerConfig())

    @classmethod
    def _rebuilt(
        cls, graph: Graph, plan: Plan, records: list[Any], config: CompilerConfig
    ) -> CompiledGraph:
        cg = cls(graph, plan, lower_program(graph, plan, config), config)
        cg.pass_records = records
        return cg

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load_pickled, (self.dump_artifacts(),))

    # PyTorch's precompile (``aot_compile`` / ``load_compiled_function``): the two class methods
    # of ``torch._dynamo.aot_compile_types.SerializableCallable`` (see :mod:`fxrt.precompile`).
    @classmethod
    def serialize_compile_artifacts(cls, fn: CompiledGraph) -> bytes:
        """``fn``'s data-only bytes and the options it runs under."""
        from .precompile import serialize

        return serialize(fn)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> CompiledGraph:
        """The graph of :meth:`serialize_compile_artifacts` bytes, validated as a cache entry."""
        from .precompile import deserialize

        with gc_paused(), outside_inference_mode():
            return deserialize(data, cls._rebuilt)

    def finalize_loading(self, *engine_state: Any) -> None:
        """Called by a serving engine on what it loaded from precompile bytes, before the first
        call (vLLM passes its config on a warm start). A loaded graph is complete: nothing is
        left to do."""

    def graph_text(self) -> str:
        return graph_to_text(self.graph)

    def __repr__(self) -> str:
        return (
            f"CompiledGraph({len(self.graph.nodes)} nodes, {len(self.program.code)} "
            f"instructions, executor={self.executor!r})"
        )


def _load_pickled(artifact: bytes) -> CompiledGraph:
    return CompiledGraph.load_artifacts(artifact)


class GraphLoop(NativeLoop):
    """The compiled loop of a :class:`CompiledGraph`, what ``torch.compile`` calls
    (:meth:`CompiledGraph.entry`): Dynamo's precompile asks the type of what it calls for the
    bytes, which are the owning graph's."""

    @classmethod
    def serialize_compile_artifacts(cls, fn: GraphLoop) -> bytes:
        return CompiledGraph.serialize_compile_artifacts(fn._owner)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Callable[..., Any]:
        return CompiledGraph.deserialize_compile_artifacts(data).entry()

    def finalize_loading(self, *engine_state: Any) -> None:
        """See :meth:`CompiledGraph.finalize_loading`."""


def _region_graph(graph: Graph, config: CompilerConfig, capture: bool) -> CompiledGraph:
    """A region of a graph that capture splits (:mod:`fxrt.exec.capturable`), compiled as a graph
    of its own: its nodes are the graph's, already through the passes, so only the plan and the
    program are made. The whole graph's call checked the inputs already."""
    config = dataclasses.replace(config, capture=capture, check_inputs=False, cache=False)
    plan = plan_lifetimes(graph)
    return CompiledGraph(graph, plan, lower_program(graph, plan, config), config)


def compile_graph(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any] | None = None,
    config: CompilerConfig | None = None,
) -> CompiledGraph:
    """Compile an ATen-level GraphModule with fxrt.

    The graph's constants (``get_attr``: a ``make_fx`` graph's parameters and buffers) stay the
    caller's live tensors: they are not folded unless ``config.freeze`` is set.

    Args:
        gm: the graph, e.g. as AOTAutograd or ``torch.export`` produce it.
        example_inputs: example (or fake) inputs, used for metadata the graph lacks.
        config: compiler options; defaults to ``CompilerConfig()`` (environment-driven).

    Returns:
        A :class:`CompiledGraph` that replaces ``gm``'s execution.
    """
    return _compile_cached(gm, example_inputs, config or CompilerConfig(), owned_constants=False)


def _compile_cached(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any] | None,
    config: CompilerConfig,
    owned_constants: bool,
) -> CompiledGraph:
    """``gm`` through the compile cache. The cache key is the IR of ``gm``; on a miss the
    pipeline takes that conversion as its ``from_fx`` stage's, unless a user pre pass changes
    ``gm`` first (then the pipeline converts what the pass left)."""
    from .cache.lookup import cached_compile  # the compile side only: a load needs no lookup

    if not config.cache:
        return _compile(gm, example_inputs, config, owned_constants=owned_constants)
    t0 = time.perf_counter()
    graph = from_fx(gm, example_inputs)
    seconds = time.perf_counter() - t0

    def build() -> CompiledGraph:
        return _compile(
            gm,
            example_inputs,
            config,
            graph,
            owned_constants=owned_constants,
            graph_seconds=seconds,
        )

    return cached_compile(graph, example_inputs, config, build, gm, rebuild=CompiledGraph._rebuilt)


def _compile(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any] | None,
    config: CompilerConfig,
    graph: Graph | None = None,
    *,
    owned_constants: bool,
    graph_seconds: float = 0.0,
) -> CompiledGraph:
    """Run the compile pipeline (:mod:`fxrt.pipeline`) on ``gm`` and build the executor.

    ``graph``: ``gm`` converted already (``graph_seconds`` it took). ``owned_constants``: the
    graph's constants are its own (tensor literals Dynamo or AOTAutograd made; the model's
    weights are graph inputs there), so constant folding may fold them. Else only
    ``config.freeze`` lets it fold them."""
    # The compile side: a graph loaded from an artifact, the cache or PyTorch's precompile
    # imports none of the pipeline's FX-side stages and passes (see fxrt.stage).
    from .pipeline import compile_stages

    cache_stats["compiled"] += 1
    with outside_inference_mode():  # what folding makes serves calls outside it too
        c = compile_stages(
            gm,
            example_inputs,
            config,
            owned_constants=owned_constants,
            graph=graph,
            graph_seconds=graph_seconds,
        )
    cg = CompiledGraph(c.graph, c.plan, c.program, config)
    cg.pass_records = c.pass_records
    cg.stage_records = c.records
    if c.dump is not None:
        c.dump.final(cg.graph, cg.program)
    return cg


def get_compiler(
    config: CompilerConfig | None = None,
) -> Callable[[torch.fx.GraphModule, Sequence[Any]], CompiledGraph]:
    """Return ``(gm, example_inputs) -> CompiledGraph`` for use as an AOTAutograd
    ``fw_compiler``/``bw_compiler`` (how third-party graph compilers integrate)."""
    config = config or CompilerConfig()

    def fxrt_compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> CompiledGraph:
        # AOTAutograd lifts parameters and buffers to inputs: its constants are literals.
        return _compile_cached(gm, example_inputs, config, owned_constants=True)

    return fxrt_compiler
