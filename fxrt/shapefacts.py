"""Symbolic-shape facts, so that a Dynamo graph with dynamic sizes is cached before fxrt's trace.

Tracing a graph with symbolic sizes to ATen (``make_fx`` on Dynamo's fakes) asks questions of
Dynamo's shape environment, and each answer becomes a guard of Dynamo's compiled code (a
decomposition that branches on ``s0 // 2 == 1`` adds ``Ne(s0 // 2, 1)``). A cache hit skips that
trace, so it must leave the shape environment exactly as the trace would have:

* **The key** holds what the trace's answers depend on besides the graph: every size symbol's
  range, Dynamo's replacements and the guards it already holds (:meth:`ShapeFacts.key`).
* **The entry** holds the guards the miss added while tracing and compiling, in order, as text
  (:meth:`ShapeFacts.recording`).
* **On a hit** each recorded guard is first checked against this call's sizes: if one is false
  here, the trace would have gone another way, and the entry is a miss. Otherwise each guard is
  asked of the shape environment again, which records it (and any replacement it implies) just as
  the trace did (:meth:`ShapeFacts.replay`).

Guards are stored as ``sympy.srepr`` text with symbols by name and read back by a closed reader:
the text may name only the symbols of this shape environment, integers, and an allow-list of
sympy and ``torch.utils._sympy`` functions (no attribute access, no strings, nothing else).
A guard whose text does not read back to the same expression, and a graph with data-dependent
(unbacked) sizes, are not cached (:class:`fxrt.fingerprint.Unkeyable`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any

from .fingerprint import Unkeyable

_SYMBOL_REPR = re.compile(r"Symbol\('([A-Za-z_]\w*)'(?:, \w+=(?:True|False))*\)")
_TEXT = re.compile(r"[A-Za-z0-9_(), \-]{1,4000}")
_FUNCTIONS = (
    "Integer Rational Add Mul Pow Equality Unequality StrictGreaterThan StrictLessThan "
    "GreaterThan LessThan And Or Not Max Min Abs floor ceiling true false "
    "FloorDiv CeilDiv CleanDiv Mod PythonMod ModularIndexing IntTrueDiv TruncToInt FloorToInt "
    "CeilToInt PowByNatural Identity"
).split()
_namespace: dict[str, Any] | None = None


def _functions() -> dict[str, Any]:
    """The names guard text may call: torch's sympy functions first, then sympy's."""
    global _namespace
    if _namespace is None:
        import sympy
        import torch.utils._sympy.functions as torch_functions

        _namespace = {}
        for name in _FUNCTIONS:
            f = getattr(torch_functions, name, None)
            if f is None:
                f = getattr(sympy, name, None)
            if f is not None:
                _namespace[name] = f
    return _namespace


def to_text(expr: Any) -> str:
    """A guard expression as text: ``srepr`` with each symbol written as its name."""
    import sympy

    return _SYMBOL_REPR.sub(r"\1", sympy.srepr(expr))


def from_text(text: Any, symbols: dict[str, Any]) -> Any:
    """Read :func:`to_text` back with this shape environment's ``symbols`` (by name).

    Raises:
        ValueError: the text is not a guard over these symbols and the allowed functions.
    """
    if not isinstance(text, str) or not _TEXT.fullmatch(text):
        raise ValueError(f"{str(text)[:60]!r} is not guard text")
    names = _functions()
    for token in re.findall(r"[A-Za-z_]\w*", text):
        if token not in names and token not in symbols:
            raise ValueError(f"guard text names {token[:30]!r}")
    # Only calls of allow-listed names on integers and known symbols can be written above: the
    # characters exclude attribute access, subscripts, strings and keywords.
    return eval(text, {"__builtins__": {}}, {**names, **symbols})  # noqa: S307


class ShapeFacts:
    """The shape environment of one Dynamo graph with symbolic sizes."""

    def __init__(self, shape_env: Any):
        self.env = shape_env

    @classmethod
    def of(cls, example_inputs: Sequence[Any]) -> ShapeFacts:
        """The facts of the graph whose (real or fake) inputs these are.

        Raises:
            Unkeyable: no shape environment, or sizes that depend on data (unbacked symbols).
        """
        import torch

        mode = torch._guards.detect_fake_mode(example_inputs)
        env = getattr(mode, "shape_env", None)
        if env is None:
            raise Unkeyable("symbolic sizes without a shape environment")
        facts = cls(env)
        facts._check_backed()
        return facts

    def _check_backed(self) -> None:
        env = self.env
        if (
            env.unbacked_symint_counter
            or env.unbacked_symfloat_counter
            or any(env.deferred_runtime_asserts.values())
        ):
            raise Unkeyable("sizes that depend on data (unbacked symbols or runtime asserts)")

    def key(self) -> str:
        """What a trace's answers depend on besides the graph, as text."""
        env = self.env
        ranges = [f"{s}:{env.var_to_range.get(s)}" for s in sorted(env.backed_var_to_val, key=str)]
        replaced = [f"{k}={v}" for k, v in sorted(env.replacements.items(), key=str)]
        guards = [to_text(g.expr) for g in env.guards]
        divisible = sorted(map(str, env.divisible))
        return repr((ranges, replaced, guards, divisible))

    def _symbols(self) -> dict[str, Any]:
        return {str(s): s for s in self.env.backed_var_to_val}

    @contextlib.contextmanager
    def recording(self, out: list[str]) -> Iterator[None]:
        """Collect, in ``out``, the guards added inside the block, as text.

        Raises:
            Unkeyable: (on exit) the block made data-dependent sizes, or a guard that does not
                read back from its text.
        """
        start = len(self.env.guards)
        yield
        self._check_backed()
        symbols = self._symbols()
        for guard in self.env.guards[start:]:
            text = to_text(guard.expr)
            try:
                same = from_text(text, symbols) == guard.expr
            except (ValueError, TypeError, SyntaxError) as e:
                raise Unkeyable(f"a shape guard that cannot be stored ({e})") from None
            if not same:
                raise Unkeyable(f"a shape guard that does not read back: {text[:80]}")
            out.append(text)

    def admits(self, texts: Any) -> bool:
        """Whether every recorded guard holds for this call's sizes (each a bool of the hints).

        Raises:
            ValueError: ``texts`` is not a list of guard text over these symbols.
        """
        import sympy

        if not isinstance(texts, list):
            raise ValueError("shape guards must be a list")
        hints = dict(self.env.backed_var_to_val)
        for text in texts:
            value = from_text(text, self._symbols()).xreplace(hints)
            if value is not sympy.true:  # false, or not decided by the sizes: the trace differs
                return False
        return True

    def replay(self, texts: list[str]) -> None:
        """Ask each recorded guard of the shape environment again, as the trace did."""
        symbols = self._symbols()
        for text in texts:
            self.env.evaluate_expr(from_text(text, symbols))
