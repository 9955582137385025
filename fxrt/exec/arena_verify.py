"""The arena plan's invariants, checked after the arena stage (:func:`verify_arena`)."""

from __future__ import annotations

import bisect

from ..ir.graph import Graph
from .arena import ALIGNMENT, ArenaPlan, Slot
from .inplace import takes_over as in_place_candidates
from .plan import Plan


class ArenaError(AssertionError):
    """An arena plan that breaks its invariants (a bug in the planner)."""


def verify_arena(graph: Graph, plan: Plan, arena: ArenaPlan) -> None:
    """Check the arena's invariants: every slot inside the arena and aligned, holding a value the
    lifetime plan frees no earlier than the slot's interval says, and no two slots whose
    intervals overlap sharing a byte (found by a sweep, :func:`_live_overlap`; when several
    pairs clash, the one named is the first the sweep meets, its lower slot index first).

    Raises:
        ArenaError: naming the values involved.
    """
    free_at = {v: i for i, vs in enumerate(plan.frees) for v in vs}
    name = {v.id: v.name for v in graph.values}
    for s in arena.slots:
        if s.offset % ALIGNMENT or s.offset < 0 or s.offset + s.nbytes > arena.nbytes:
            raise ArenaError(f"slot of %{name[s.value]} at {s.offset}+{s.nbytes} is misplaced")
        if s.value in plan.pinned or free_at.get(s.value, -1) > s.last:
            raise ArenaError(f"%{name[s.value]} outlives its arena slot")
        if s.value not in graph.nodes[s.first].outputs:
            raise ArenaError(f"slot of %{name[s.value]}: node {s.first} does not make it")
    for i, s in enumerate(arena.slots):  # a node's results: all in slots side by side, in order
        outs = graph.nodes[s.first].outputs
        if s.value == outs[0] and [t.value for t in arena.slots[i : i + len(outs)]] != outs:
            raise ArenaError(f"the results of node {s.first} are not in slots side by side")
    by_value = {s.value: s for s in arena.slots}
    made_by = {v: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    for s in arena.slots:
        if s.takes_over < 0:
            continue
        t = by_value.get(s.takes_over)
        if s.takes_over not in in_place_candidates(graph, made_by, s.first):
            raise ArenaError(
                f"%{name[s.value]} takes over the slot of %{name[s.takes_over]}, which its op "
                "does not read element for element with the same geometry"
            )
        if t is None or (t.offset, t.nbytes, t.last) != (s.offset, s.nbytes, s.first):
            raise ArenaError(
                f"%{name[s.value]} takes over a slot that does not end where it starts"
            )
    clash = _live_overlap(arena.slots)
    if clash is not None:
        a, b = (arena.slots[i] for i in sorted(clash))
        raise ArenaError(
            f"%{name[a.value]} and %{name[b.value]} are live together and overlap in the arena"
        )


def _live_overlap(slots: tuple[Slot, ...]) -> tuple[int, int] | None:
    """Indices of two slots live at a common node (``a.first <= b.last and b.first <= a.last``)
    that share a byte (``a.offset < b.end and b.offset < a.end``), or None.

    A sweep over node indices instead of a test of every pair: slots start in order of ``first``
    and leave once a later start is past their ``last``; the live ones are kept sorted by
    ``(offset, end)``. While no two live slots share a byte, that order is a chain (each one
    starts at or after the previous one ends), and a new slot that shares a byte with any live
    slot shares one with the slot just before or just after its place in that order: those two
    are the only ones tested. The first clash stops the sweep, so the chain property holds
    throughout. Degenerate slots (negative size or ``first > last``, which the planner never
    makes) are tested against every slot the old way.
    """
    sane = [i for i, s in enumerate(slots) if s.nbytes >= 0 and s.first <= s.last]
    if len(sane) < len(slots):
        for i, a in enumerate(slots):
            if a.nbytes >= 0 and a.first <= a.last:
                continue
            for j, b in enumerate(slots):
                if j != i and _clash(a, b):
                    return i, j
    by_end = sorted(sane, key=lambda i: slots[i].last)
    live: list[tuple[int, int, int]] = []  # (offset, end, slot index), sorted
    gone = 0
    for i in sorted(sane, key=lambda i: slots[i].first):
        s = slots[i]
        while gone < len(by_end) and slots[by_end[gone]].last < s.first:
            j = by_end[gone]
            key = (slots[j].offset, slots[j].offset + slots[j].nbytes, j)
            del live[bisect.bisect_left(live, key)]
            gone += 1
        key = (s.offset, s.offset + s.nbytes, i)
        pos = bisect.bisect_left(live, key)
        for _, _, j in live[max(pos - 1, 0) : pos + 1]:
            if _clash(s, slots[j]):
                return i, j
        live.insert(pos, key)
    return None


def _clash(a: Slot, b: Slot) -> bool:
    if a.takes_over == b.value or b.takes_over == a.value:
        return False  # one writes over the other in place (verify_arena checked the hand-over)
    live_together = a.first <= b.last and b.first <= a.last
    return live_together and a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes


__all__ = ["ArenaError", "verify_arena"]
