"""What the compile pipeline's stages leave behind: a :class:`PassRecord` per stage that ran, and
a :class:`PassError` when a pass fails.

A module of its own, importing nothing of fxrt, because the passes (which raise the error), the
stage manager (:mod:`fxrt.stage`), the compiled graph and the artifact decoder (which keep and
store the records) all need them, and a graph loaded from an artifact should not import the passes
to hold its records.
"""

from __future__ import annotations

from dataclasses import dataclass


class PassError(RuntimeError):
    """A graph pass failed; the message names the pass."""


@dataclass(frozen=True)
class PassRecord:
    """What one stage of the compile pipeline did: its name, its wall time in seconds (its
    verification included) and whether it changed the graph's text."""

    name: str
    seconds: float
    changed: bool


__all__ = ["PassError", "PassRecord"]
