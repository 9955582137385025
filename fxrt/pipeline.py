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

The manager, :func:`fxrt.stage.run_stage`, does the same for every stage:

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

:func:`compile_stages` runs the whole list on an FX graph; :func:`~fxrt.stage.lower_program` runs
the stages after ``plan_lifetimes`` on a graph and plan loaded from an artifact, the cache or a
package. The manager, the stage type and the planning stages live in :mod:`fxrt.stage`, so that a
load imports neither the passes nor the FX-side stages.

The pipeline is a module of its own, above :mod:`fxrt.passes`, :mod:`fxrt.ops` and
:mod:`fxrt.exec`, because its stages come from all three; :mod:`fxrt.passes` stays a set of
``Graph -> Graph`` functions that import nothing from :mod:`fxrt.exec`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .config import CompilerConfig
from .dump import Dumper
from .ir import Graph, from_fx
from .ir.to_fx import to_fx
from .ops.overrides import apply_kernel_overrides
from .ops.own_ops import available as own_ops_available
from .ops.own_ops import available_op, use_own_ops
from .passes import DEFAULT_MAX_BYTES, PASSES, fold_constants, fuse_attention, fuse_patterns
from .passes.assign_streams import assign_streams
from .passes.fuse_attention import FUSED_ATTENTION
from .passes.host_graph import REWRITES as HOST_GRAPH_REWRITES
from .passes.synchronize_streams import remove_streams, synchronize_streams
from .passes.user import run_user_pass
from .stage import PLANNING, Compilation, Stage, lower_program, run_stage

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
            c.graph = fuse_attention(c.graph, available_op("softcap_sdpa"))
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
    *PLANNING,
)


def stages(config: CompilerConfig) -> list[Stage]:
    """The stages a compile under ``config`` runs, in order: :data:`PIPELINE` with the built-in
    passes in the place of ``passes`` and without the stages ``config`` leaves out (a loaded
    graph runs the planning ones only: :func:`fxrt.stage.lower_program`)."""
    out: list[Stage] = []
    for s in PIPELINE:
        if s.expand is not None:
            out.extend(s.expand(config))
        elif s.when(config):
            out.append(s)
    return out


def run(c: Compilation) -> Compilation:
    """Run the stages of ``c.config``'s pipeline on ``c``; return ``c``."""
    if c.dump is not None and c.gm is not None:
        c.dump.fx("input_fx.txt", c.gm)
    for stage in stages(c.config):
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
