"""The arena planner's index of placed slots by node interval
(:func:`fxrt.exec.arena.plan_arena`)."""

from __future__ import annotations

import bisect
from typing import Any


class SlotIndex:
    """The slots placed so far, indexed by their node intervals, so that finding those live at
    the same time as a new one costs O(log n + found) rather than a scan of every placed slot
    (which made placement quadratic in the graph's length).

    A placed slot overlaps ``[first, last]`` in time when it starts inside it, or starts before
    ``first`` and is still live at ``first``. The first kind comes from the sorted start
    indices; the second from a segment tree over node indices where each slot is stored at the
    O(log n) tree nodes whose ranges tile its interval, so the slots live at ``first`` are those
    stored on the path from ``first``'s leaf to the root. The two kinds are disjoint, so no slot
    is reported twice.
    """

    def __init__(self, n_nodes: int):
        self.slots: list[Any] = []  # in placement order
        self.size = 1 << max(n_nodes - 1, 0).bit_length()  # leaves: a power of two >= n_nodes
        # Per tree node (1 is the root, leaf i is size + i): the slots busy over its whole range,
        # with the node where each one's busy interval starts.
        self.cover: list[list[tuple[Any, int]] | None] = [None] * (2 * self.size)
        self.firsts: list[int] = []  # distinct start indices, sorted
        self.starting: dict[int, list[tuple[Any, int]]] = {}  # start -> slots busy from there

    def add(self, s: Any, first: int, last: int) -> None:
        """Place ``s``, busy over nodes ``first..last`` (its own interval, or a wider one)."""
        self.slots.append(s)
        cover = self.cover
        lo, hi = first + self.size, last + self.size + 1
        tiles = []  # the tree nodes whose ranges tile [first, last]
        while lo < hi:
            if lo & 1:
                tiles.append(lo)
                lo += 1
            if hi & 1:
                hi -= 1
                tiles.append(hi)
            lo >>= 1
            hi >>= 1
        for k in tiles:
            if cover[k] is None:
                cover[k] = [(s, first)]
            else:
                cover[k].append((s, first))
        if first not in self.starting:
            bisect.insort(self.firsts, first)
            self.starting[first] = []
        self.starting[first].append((s, first))

    def overlapping(self, first: int, last: int) -> list[Any]:
        """The placed slots with ``s.first <= last and first <= s.last``."""
        found = []
        cover = self.cover
        k = first + self.size
        while k:
            here = cover[k]
            if here is not None:
                for s, busy_first in here:
                    if busy_first < first:
                        found.append(s)
            k >>= 1
        firsts, starting = self.firsts, self.starting
        lo = bisect.bisect_left(firsts, first)
        for i in range(lo, bisect.bisect_right(firsts, last, lo)):
            found.extend(s for s, _ in starting[firsts[i]])
        return found


__all__ = ["SlotIndex"]
