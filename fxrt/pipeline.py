"""The compile pipeline: one declared list of stages, each run by the same manager.

:data:`PIPELINE`, in order (a stage in brackets runs only when the config asks for it)::

    stage                          reads -> makes      module
    [post_grad_custom_pre_pass]    FX -> FX            the user's pre pass (fxrt.passes.user)
    [rewrite_to_aten, use_functional_variants, simplify_views, use_reinterpret_views]
                                   FX -> FX            Inductor's host graph, inductor_host_graph
                                                       (fxrt.passes.host_graph)
    from_fx                        FX -> IR            fxrt.ir.from_fx
    apply_kernel_overrides         IR -> IR            fxrt.register_kernel (fxrt.ops.overrides)
    <config.pass_names()>          IR -> IR            the built-in passes, one stage each
    [post_grad_custom_post_pass]   IR -> FX -> IR      the user's post pass, on FX
    [use_own_ops]                  IR -> IR            fxrt's own CPU ops (fxrt.ops.own_ops)
    [assign_streams]               IR -> IR            streams="auto" (fxrt.passes.assign_streams)
    synchronize_streams            IR -> IR            record/wait (passes.synchronize_streams)
    plan_lifetimes                 IR -> Plan          last uses, FREEs (fxrt.exec.plan)
    [plan_arena]                   IR, Plan -> arena   inline views, slots (fxrt.exec.arena)
    lower                          ... -> Program      fxrt.exec.program

The order has reasons. The user's pre pass edits the FX graph it is handed, so it runs before the
conversion, and the conversion runs once, on what the pass left (a graph converted before it, for
the cache key, is dropped). Inductor's host-graph rewrites come next: they turn its Python-level
calls into ATen ops before anything reads the ops. Overrides come right after the conversion, so
that the passes see the ops that will run. The FX round trip happens only around the user's
post pass, which needs FX. fxrt's own ops come last among the rewrites: user passes see ATen
ops, and a node a user overrode no longer has the ATen op the rewrite looks for, so the user's
override wins. Streams are ordered last, on the graph that will run: a rewrite may move a use to
another stream.

The manager, :func:`run_stage`, does the same for every stage:

* times it, and records ``PassRecord(name, seconds, changed)`` in ``Compilation.records`` (the
  built-in passes' records also in ``Compilation.pass_records``, which ``CompiledGraph``
  keeps and artifacts store); ``changed`` says whether the graph's canonical text changed
  (:mod:`fxrt.ir.snapshot`; the user pre pass: its FX code), and the planning stages never change
  it;
* when ``config.verify``, checks what the stage made: the IR verifier after a stage that changed
  the graph (an unchanged graph was verified already), ``verify_arena`` after the arena stage; the
  check is part of the stage's time;
* names a built-in pass that raises in a :class:`~fxrt.passes.PassError`;
* with ``FXRT_DUMP_DIR``, writes what the stage made to the graph's dump folder:
  ``00_input_fx.txt`` first, then ``NN_after_<stage>.txt`` per stage (``after_pre_pass_fx.txt``
  and ``after_post_pass_fx.txt`` for the user passes: FX text; the IR for the rewrites; the plan,
  the arena and the program listing for the last three). :mod:`fxrt.compiler` writes the final
  files (``ir.txt``, ``program.txt``, ``ir.dot``) once the executor is built.

:func:`compile_stages` runs the whole list on an FX graph; :func:`lower_program` runs the stages
after ``plan_lifetimes`` on a graph and plan loaded from an artifact or the cache.

The pipeline is a module of its own, above :mod:`fxrt.passes`, :mod:`fxrt.ops` and
:mod:`fxrt.exec`, because its stages come from all three; :mod:`fxrt.passes` stays a set of
``Graph -> Graph`` functions that import nothing from :mod:`fxrt.exec`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .config import CompilerConfig
from .dump import Dumper
from .exec.arena import ArenaPlan, plan_arena, verify_arena
from .exec.plan import Plan, plan_lifetimes
from .exec.program import Program, lower
from .exec.views import inline_views
from .ir import Graph, from_fx, verify
from .ir.snapshot import Snapshot, changed_since
from .ir.to_fx import to_fx
from .ops.overrides import apply_kernel_overrides
from .ops.own_ops import available as own_ops_available
from .ops.own_ops import use_own_ops
from .passes import (
    DEFAULT_MAX_BYTES,
    PASSES,
    PassError,
    PassRecord,
    fold_constants,
    fuse_attention,
    fuse_patterns,
)
from .passes.assign_streams import assign_streams
from .passes.fuse_attention import FUSED_ATTENTION
from .passes.host_graph import REWRITES as HOST_GRAPH_REWRITES
from .passes.synchronize_streams import remove_streams, synchronize_streams
from .passes.user import run_user_pass


@dataclass
class Compilation:
    """What the stages hand on to each other, and what they recorded."""

    config: CompilerConfig
    gm: torch.fx.GraphModule | None = None  # the FX graph, while a stage works on FX
    example_inputs: Sequence[Any] | None = None
    # The graph's constants are its own (tensor literals Dynamo or AOTAutograd made; the model's
    # weights are graph inputs there), so constant folding may fold them. Else only
    # ``config.freeze`` lets it.
    owned_constants: bool = False
    graph: Graph | None = None
    plan: Plan | None = None
    arena: ArenaPlan | None = None
    views: frozenset[int] = frozenset()  # node indices made inline on calls with the arena
    program: Program | None = None
    records: list[PassRecord] = field(default_factory=list)  # every stage that ran, in order
    pass_records: list[PassRecord] = field(default_factory=list)  # the built-in passes'
    dump: Dumper | None = None
    # Seconds of a stage's work done before the pipeline ran, added to its record: the cache
    # key's conversion, which the ``from_fx`` stage reuses.
    done_before: dict[str, float] = field(default_factory=dict)


def _always(_config: CompilerConfig) -> bool:
    return True


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline (see the module docstring)."""

    name: str  # its record's name: a verb, or the user pass's option name
    # What it makes, which says how it is checked and whether it can change the graph:
    # "fx" (edits Compilation.gm), "ir" (a new graph from FX), "graph" (a rewrite of the
    # graph), "plan", "arena" or "program".
    makes: str
    run: Callable[[Compilation], None]
    when: Callable[[CompilerConfig], bool] = _always
    dumps: str = "ir"  # what its dump file holds: "fx", "ir", "plan", "arena" or "program"
    dump_name: str | None = None  # default: after_<name>.txt
    builtin_pass: bool = False
    # The placeholder for the built-in passes: the stages that stand in its place.
    expand: Callable[[CompilerConfig], tuple[Stage, ...]] | None = None


# ----------------------------------------------------------------------------------------------
# The stages


def _user_pre_pass(c: Compilation) -> None:
    fn = c.config.post_grad_custom_pre_pass
    c.gm = run_user_pass(fn, "post_grad_custom_pre_pass", c.gm, c.example_inputs, c.config)
    c.graph = None  # converted from the FX graph before the pass changed it


def _host_graph_rewrite(fn: Callable[[torch.fx.GraphModule], int]) -> Stage:
    def run(c: Compilation) -> None:
        fn(c.gm)

    return Stage(fn.__name__, "fx", run, when=lambda config: config.inductor_host_graph, dumps="fx")


def _from_fx(c: Compilation) -> None:
    if c.graph is None:
        c.graph = from_fx(c.gm, c.example_inputs)


def _apply_kernel_overrides(c: Compilation) -> None:
    c.graph = apply_kernel_overrides(c.graph)


def _user_post_pass(c: Compilation) -> None:
    fn = c.config.post_grad_custom_post_pass
    c.gm = run_user_pass(
        fn, "post_grad_custom_post_pass", to_fx(c.graph), c.example_inputs, c.config
    )
    c.graph = from_fx(c.gm, c.example_inputs)


def _use_own_ops(c: Compilation) -> None:
    c.graph = use_own_ops(c.graph)


def _assign_streams(c: Compilation) -> None:
    c.graph = assign_streams(c.graph, c.config.max_streams)


def _synchronize_streams(c: Compilation) -> None:
    if c.config.streams == "off":
        c.graph = remove_streams(c.graph)
    else:
        c.graph = synchronize_streams(c.graph, strict=c.config.strict_streams)


def _plan_lifetimes(c: Compilation) -> None:
    c.plan = plan_lifetimes(c.graph)


def _plan_arena(c: Compilation) -> None:
    views = inline_views(c.graph)
    c.arena = plan_arena(c.graph, c.plan, views)
    c.views = views if c.arena is not None else frozenset()


def _lower(c: Compilation) -> None:
    c.program = lower(
        c.graph,
        c.plan,
        c.arena,
        c.views,
        check_inputs=c.config.check_inputs,
        elementwise=c.config.own_ops,
    )


def _builtin_pass(name: str) -> Callable[[Compilation], None]:
    fn = PASSES[name]

    def run(c: Compilation) -> None:
        # Outside any fake mode (AOTAutograd compiles its graphs under one): the constants a
        # pass computes (a folded mask, fused attention's additive mask) are real tensors.
        with unset_fake_temporarily():
            _run_builtin(c, fn)

    return run


def _run_builtin(c: Compilation, fn: Callable[[Graph], Graph]) -> None:
    if fn is fold_constants:
        foldable = None if c.owned_constants or c.config.freeze else frozenset()
        max_bytes = c.config.fold_max_bytes or DEFAULT_MAX_BYTES
        c.graph = fold_constants(c.graph, max_bytes, foldable=foldable)
    elif fn is fuse_attention:
        # Only where fxrt::attention will run the fused op: ATen's flash kernel costs more
        # than the unfused ops at the sizes it is for.
        if c.config.own_ops and FUSED_ATTENTION in own_ops_available():
            c.graph = fuse_attention(c.graph)
    elif fn is fuse_patterns:
        c.graph = fuse_patterns(c.graph, c.config.disable_patterns, c.config.own_ops)
    else:
        c.graph = fn(c.graph)


_PASS_STAGES = {
    name: Stage(name, "graph", _builtin_pass(name), builtin_pass=True) for name in PASSES
}


def _expanded(_c: Compilation) -> None:
    raise AssertionError("the built-in passes run as the stages stages() puts in their place")


def _builtin_passes(config: CompilerConfig) -> tuple[Stage, ...]:
    return tuple(_PASS_STAGES[name] for name in config.pass_names())


PIPELINE: tuple[Stage, ...] = (
    Stage(
        "post_grad_custom_pre_pass",
        "fx",
        _user_pre_pass,
        when=lambda config: config.post_grad_custom_pre_pass is not None,
        dumps="fx",
        dump_name="after_pre_pass_fx.txt",
    ),
    *(_host_graph_rewrite(fn) for fn in HOST_GRAPH_REWRITES),
    Stage("from_fx", "ir", _from_fx),
    Stage("apply_kernel_overrides", "graph", _apply_kernel_overrides),
    Stage("passes", "graph", _expanded, expand=_builtin_passes),
    Stage(
        "post_grad_custom_post_pass",
        "graph",
        _user_post_pass,
        when=lambda config: config.post_grad_custom_post_pass is not None,
        dumps="fx",
        dump_name="after_post_pass_fx.txt",
    ),
    Stage("use_own_ops", "graph", _use_own_ops, when=lambda config: config.own_ops),
    Stage("assign_streams", "graph", _assign_streams, when=lambda config: config.streams == "auto"),
    Stage("synchronize_streams", "graph", _synchronize_streams),
    Stage("plan_lifetimes", "plan", _plan_lifetimes, dumps="plan"),
    Stage("plan_arena", "arena", _plan_arena, when=lambda config: config.arena, dumps="arena"),
    Stage("lower", "program", _lower, dumps="program"),
)


def stages(config: CompilerConfig, after: str | None = None) -> list[Stage]:
    """The stages a compile under ``config`` runs, in order: :data:`PIPELINE` with the built-in
    passes in the place of ``passes`` and without the stages ``config`` leaves out; only those
    after the stage named ``after``, if given."""
    start = 0 if after is None else [s.name for s in PIPELINE].index(after) + 1
    out: list[Stage] = []
    for s in PIPELINE[start:]:
        if s.expand is not None:
            out.extend(s.expand(config))
        elif s.when(config):
            out.append(s)
    return out


# ----------------------------------------------------------------------------------------------
# The manager


def run_stage(c: Compilation, stage: Stage) -> PassRecord:
    """Run one stage on ``c``: timed, checked, recorded and dumped (see the module docstring)."""
    makes = stage.makes
    check = c.config.verify
    before: Any = None
    if makes == "graph":
        before = Snapshot(c.graph)
    elif makes == "fx":
        before = getattr(c.gm, "code", None)
    t0 = time.perf_counter()
    try:
        stage.run(c)
        if makes == "graph":
            changed = changed_since(before, c.graph)
        elif makes == "fx":
            changed = getattr(c.gm, "code", None) != before
        else:
            changed = makes == "ir"
        if check and changed and makes in ("ir", "graph"):
            verify(c.graph)
        elif check and makes == "arena" and c.arena is not None:
            verify_arena(c.graph, c.plan, c.arena)
    except Exception as e:
        if stage.builtin_pass:
            raise PassError(f"fxrt pass {stage.name!r} failed: {type(e).__name__}: {e}") from e
        raise
    seconds = time.perf_counter() - t0 + c.done_before.pop(stage.name, 0.0)
    record = PassRecord(stage.name, seconds, changed)
    c.records.append(record)
    if stage.builtin_pass:
        c.pass_records.append(record)
    if c.dump is not None:
        _dump(c.dump, stage, c)
    return record


def _dump(dump: Dumper, stage: Stage, c: Compilation) -> None:
    name = stage.dump_name or f"after_{stage.name}.txt"
    what = stage.dumps
    if what == "fx":
        dump.fx(name, c.gm)
    elif what == "ir":
        dump.ir(name, c.graph)
    elif what == "program":
        dump.numbered(name, str(c.program))
    else:
        names = {v.id: v.name for v in c.graph.values}
        if what == "plan":
            text = c.plan.text(names)
        elif c.arena is not None:
            text = c.arena.text(names)
        else:
            text = "no arena: no value can live in one and no view is made inline"
        dump.numbered(name, text)


def run(c: Compilation, after: str | None = None) -> Compilation:
    """Run the stages of ``c.config``'s pipeline on ``c`` (only those after the stage named
    ``after``, if given); return ``c``."""
    if after is None and c.dump is not None and c.gm is not None:
        c.dump.fx("input_fx.txt", c.gm)
    for stage in stages(c.config, after):
        run_stage(c, stage)
    return c


def compile_stages(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any] | None,
    config: CompilerConfig,
    *,
    owned_constants: bool,
    graph: Graph | None = None,
    graph_seconds: float = 0.0,
) -> Compilation:
    """Every stage, on the ATen-level FX graph ``gm``. ``graph``: ``gm`` converted already (for
    the cache key, in ``graph_seconds``), which the ``from_fx`` stage then takes as it is,
    unless a user pre pass changes ``gm`` first."""
    c = Compilation(
        config,
        gm,
        example_inputs,
        owned_constants,
        graph=graph,
        dump=Dumper(config.dump_dir) if config.dump_dir else None,
    )
    if graph is not None and config.post_grad_custom_pre_pass is not None:
        c.graph = None  # the pre pass edits gm: the stages convert what it leaves
    elif graph is not None:
        c.done_before["from_fx"] = graph_seconds
    return run(c)


def lower_program(graph: Graph, plan: Plan, config: CompilerConfig) -> Program:
    """The stages after ``plan_lifetimes`` (arena, lower) on a graph and its plan, as a loaded
    artifact or cache entry has them; nothing is dumped or kept of their records."""
    c = run(Compilation(config, graph=graph, plan=plan), after="plan_lifetimes")
    assert c.program is not None
    return c.program


__all__ = [
    "PIPELINE",
    "Compilation",
    "Stage",
    "compile_stages",
    "lower_program",
    "run",
    "run_stage",
    "stages",
]
