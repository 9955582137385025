"""What the artifact format shares between writing and reading: its name, its error, the Python
callables and the torch enums it may name, and what made an artifact (:func:`versions`)."""

from __future__ import annotations

import math
import operator
import re
from typing import Any

import torch

from ..fingerprint import source_hash
from ..ir.graph import Graph, Node, Ref, ValueKind

FORMAT = "fxrt-artifact/2"


class SerializationError(ValueError):
    """A graph holds something the data-only format cannot represent, or an artifact is invalid."""


# Pure arithmetic and comparison: the only Python callables an artifact may name.
_OPERATORS = (
    "add sub mul truediv floordiv mod pow neg pos abs eq ne lt le gt ge "
    "and_ or_ xor not_ invert truth lshift rshift"
).split()
PYTHON_FALLBACKS: dict[str, Any] = {f"operator.{n}": getattr(operator, n) for n in _OPERATORS}
PYTHON_FALLBACKS.update({f"math.{n}": getattr(math, n) for n in ("floor", "ceil", "trunc", "sqrt")})
for _n in ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_sqrt", "sym_ite"):
    if hasattr(torch, _n):
        PYTHON_FALLBACKS[f"torch.{_n}"] = getattr(torch, _n)
_PY_NAME = {id(fn): name for name, fn in PYTHON_FALLBACKS.items()}
_SCALAR_KINDS = (ValueKind.SYM, ValueKind.SCALAR)

_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {str(x): x for x in vars(torch).values() if isinstance(x, torch.layout)}
_FORMATS = {str(x): x for x in vars(torch).values() if isinstance(x, torch.memory_format)}
# A symbolic value as fxrt prints it (``4*s0*s1``, ``Max(1, s0)``, ``(s0//2)``,
# ``IntTrueDiv(s0, 3)``): size symbols, a few sympy functions and torch's integer / float
# conversions (names sympy reads as functions), integers and arithmetic. Anything else could make
# sympy evaluate code.
_SYMBOL = re.compile(
    r"[su]\d+|Max|Min|floor|ceiling|FloorDiv|CeilDiv|Mod|PythonMod|Abs|IntTrueDiv|FloatTrueDiv"
    r"|ToFloat|TruncToInt|TruncToFloat|FloorToInt|CeilToInt|RoundToInt|PowByNatural|FloatPow"
)
_EXPR = re.compile(r"[A-Za-z0-9_ +\-*/(),%.]{1,2000}")


def versions() -> dict[str, str]:
    """What an artifact (and a cache key) was made by: fxrt's version and the hash of its
    sources (:func:`fxrt.fingerprint.source_hash`), and torch's version."""
    from .. import __version__

    return {"fxrt": __version__, "fxrt_source": source_hash(), "torch": torch.__version__}


def _fail(msg: str) -> SerializationError:
    return SerializationError(f"invalid fxrt artifact: {msg}")


def _want(x: Any, typ: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(x, typ) or (typ is int and isinstance(x, bool)):
        names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise _fail(f"{where}: expected {names}, got {type(x).__name__}")
    return x


def _int(x: Any, where: str, lo: int = -(2**63), hi: int = 2**63 - 1) -> int:
    _want(x, int, where)
    if isinstance(x, bool) or not lo <= x <= hi:
        raise _fail(f"{where}: {x!r} is out of range [{lo}, {hi}]")
    return x


def _size_expr(x: Any, where: str) -> int | str:
    if isinstance(x, int) and not isinstance(x, bool):
        return _int(x, where, 0)
    _want(x, str, where)
    if not _EXPR.fullmatch(x) or any(
        not _SYMBOL.fullmatch(tok) for tok in re.findall(r"[A-Za-z_]\w*", x)
    ):
        raise _fail(f"{where}: {x[:60]!r} is not a size expression")
    return x


def _check_python_args(graph: Graph, node: Node) -> None:
    """A Python fallback computes on SymInts and Python numbers only."""
    if node.kwargs or not all(
        (isinstance(a, Ref) and graph.values[a.id].kind in _SCALAR_KINDS)
        or (isinstance(a, (int, float, bool)) and not isinstance(a, Ref))
        for a in node.args
    ):
        raise SerializationError(
            f"node {node.name}: Python fallback {node.op.name} must take SymInts and numbers only"
        )
