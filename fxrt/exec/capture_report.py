"""What whole-graph capture did (:meth:`fxrt.CompiledGraph.capture_report`): per input
signature, whether it was captured, how its calls ran, and why what runs the loop does."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SignatureReport:
    """One input signature's capture: how its calls ran, and why it is not captured."""

    signature: str
    captured: bool = False
    captures: int = 0  # recaptures included
    replays: int = 0
    loop_calls: int = 0
    copied_inputs: tuple[int, ...] = ()
    fixed_inputs: tuple[int, ...] = ()
    reason: str = ""  # why its calls run the loop (empty: they do not, or it is warming up)

    def line(self) -> str:
        if self.captured:
            state = (
                f"captured ({self.captures} capture(s), {self.replays} replay(s); inputs copied "
                f"in: {list(self.copied_inputs)}, {len(self.fixed_inputs)} read in place)"
            )
        elif self.reason:
            state = f"not captured: {self.reason}"
        else:
            state = "warming up"
        return f"{self.signature}: {state}; {self.loop_calls} loop call(s)"


@dataclass
class CaptureReport:
    """What :meth:`fxrt.CompiledGraph.capture_report` returns; ``str()`` reads it."""

    graph: str
    enabled: bool
    reason: str = ""  # why the whole graph runs the loop (empty: it does not)
    signatures: list[SignatureReport] = field(default_factory=list)
    # A graph split into regions (some nodes cannot be captured): per region, its nodes and
    # either its own report (captured regions) or why it runs on the loop.
    regions: list[tuple[str, CaptureReport | str]] = field(default_factory=list)

    @property
    def captured(self) -> int:
        """Captured signatures, of the graph or of its regions."""
        return sum(s.captured for s in self.signatures) + sum(
            r.captured for _, r in self.regions if isinstance(r, CaptureReport)
        )

    def __str__(self) -> str:
        if not self.enabled:
            return f"capture of {self.graph}: off"
        head = f"capture of {self.graph}: {self.captured} signature(s) captured"
        if self.reason:
            head += f"; the graph runs the loop: {self.reason}"
        lines = [head, *("  " + s.line() for s in self.signatures)]
        if self.regions:
            lines[0] += f", in {len(self.regions)} regions"
        for nodes, r in self.regions:
            if isinstance(r, str):
                lines.append(f"  region {nodes}: runs on the loop: {r}")
            else:
                lines.append(f"  region {nodes}: " + str(r).split("\n", 1)[0].split(": ", 1)[1])
                lines.extend("    " + s.line() for s in r.signatures)
        return "\n".join(lines)


def copy_report(r: SignatureReport) -> SignatureReport:
    return SignatureReport(**vars(r))


__all__ = ["CaptureReport", "SignatureReport", "copy_report"]
