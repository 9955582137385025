"""A stage of the compile pipeline, the manager that runs every stage the same way, and the
planning stages (``plan_lifetimes``, ``plan_arena``, ``lower``).

:mod:`fxrt.pipeline` declares the whole list and says what the manager does for each stage. This
module is the part of it that a graph loaded from an artifact, the compile cache, PyTorch's
precompile or a package needs (:func:`lower_program`: the stages after ``plan_lifetimes`` on a
loaded graph and plan), so that a load imports neither the passes nor the FX-side stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx

from .config import CompilerConfig
from .dump import Dumper
from .exec.arena import ArenaPlan, plan_arena
from .exec.arena_verify import verify_arena
from .exec.plan import Plan, plan_lifetimes
from .exec.program import Program, lower
from .exec.views import inline_views
from .ir import Graph, verify
from .ir.snapshot import Snapshot, changed_since
from .records import PassError, PassRecord


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
# The planning stages


def _plan_lifetimes(c: Compilation) -> None:
    c.plan = plan_lifetimes(c.graph)


def _plan_arena(c: Compilation) -> None:
    views = inline_views(c.graph)
    c.arena = plan_arena(c.graph, c.plan, views, headroom=c.config.arena_headroom)
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


# The planning stages, the last of :data:`fxrt.pipeline.PIPELINE`.
PLANNING: tuple[Stage, ...] = (
    Stage("plan_lifetimes", "plan", _plan_lifetimes, dumps="plan"),
    Stage("plan_arena", "arena", _plan_arena, when=lambda config: config.arena, dumps="arena"),
    Stage("lower", "program", _lower, dumps="program"),
)


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


def lower_program(graph: Graph, plan: Plan, config: CompilerConfig) -> Program:
    """The stages after ``plan_lifetimes`` (arena, lower) on a graph and its plan, as a loaded
    artifact or cache entry has them; nothing is dumped or kept of their records."""
    c = Compilation(config, graph=graph, plan=plan)
    for stage in PLANNING[1:]:
        if stage.when(config):
            run_stage(c, stage)
    assert c.program is not None
    return c.program


__all__ = ["PLANNING", "Compilation", "Stage", "lower_program", "run_stage"]
