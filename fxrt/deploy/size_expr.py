"""Derived sizes of a package's signature (``"2*s0"``, ``"s0 + 1"``, ``"(s0//2)"``,
``"Max(1, s0)"``), compiled once into a function of the bound size symbols.

The grammar and the arithmetic are the C++ runtime's (``csrc/src/size_expr.h``): integers, size
symbols, ``+ - * // %`` with Python's floor semantics, unary minus, parentheses, ``Max(a, b)`` and
``Min(a, b)``, on 64-bit integers. An expression outside that grammar, an unbound symbol, a
division by zero or an overflow gives None: the size is then not checked, by either runtime.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

Env = Mapping[str, int]
SizeFn = Callable[[Env], "int | None"]

_LO, _HI = -(2**63), 2**63 - 1
_TOKEN = re.compile(r"\s*(//|Max\(|Min\(|[-+*%(),]|[A-Za-z0-9]+)")


def _int64(v: int | None) -> int | None:
    return v if v is not None and _LO <= v <= _HI else None


def _floordiv(a: int, b: int, mod: bool) -> int | None:
    if b == 0 or (a == _LO and b == -1):
        return None
    return a % b if mod else a // b


class _Unsupported(Exception):
    pass


def compile_size(text: str) -> SizeFn:
    """The function computing ``text`` from a symbol -> value mapping (None: not checked)."""
    tokens = _tokens(text)
    if tokens is None:
        return lambda env: None
    pos = 0
    depth = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def binary(op: str, left: SizeFn, right: SizeFn) -> SizeFn:
        def fn(env: Env) -> int | None:
            a = left(env)
            b = right(env) if a is not None else None
            if a is None or b is None:
                return None
            if op == "+":
                return _int64(a + b)
            if op == "-":
                return _int64(a - b)
            if op == "*":
                return _int64(a * b)
            return _floordiv(a, b, op == "%")

        return fn

    def sum_() -> SizeFn:
        fn = product()
        while peek() in ("+", "-"):
            op = take()
            fn = binary(op, fn, product())
        return fn

    def product() -> SizeFn:
        fn = factor()
        while peek() in ("*", "//", "%"):
            op = take()
            fn = binary(op, fn, factor())
        return fn

    def factor() -> SizeFn:
        nonlocal depth
        depth += 1
        if depth > 64:
            raise _Unsupported
        tok = take() if peek() is not None else None
        if tok == "(":
            fn = sum_()
            if peek() != ")":
                raise _Unsupported
            take()
            return fn
        if tok == "-":
            inner = factor()
            return lambda env: (lambda v: None if v is None or v == _LO else -v)(inner(env))
        if tok in ("Max(", "Min("):
            a = sum_()
            if peek() != ",":
                raise _Unsupported
            take()
            b = sum_()
            if peek() != ")":
                raise _Unsupported
            take()
            pick = max if tok == "Max(" else min

            def fn(env: Env) -> int | None:
                x, y = a(env), b(env)
                return None if x is None or y is None else pick(x, y)

            return fn
        if tok is not None and tok.isdigit() and len(tok) < 18:
            value = int(tok)
            return lambda env: value
        if tok is not None and tok.isalnum():
            return lambda env: env.get(tok)
        raise _Unsupported

    try:
        fn = sum_()
    except (_Unsupported, IndexError):
        return lambda env: None
    if pos != len(tokens):
        return lambda env: None
    return fn


def _tokens(text: str) -> list[str] | None:
    out, pos = [], 0
    stripped = text.rstrip(" ")
    while pos < len(stripped):
        m = _TOKEN.match(stripped, pos)
        if m is None or (m.group(0).strip() == "" and m.end() == pos):
            return None
        out.append(m.group(1))
        pos = m.end()
    return out


__all__ = ["SizeFn", "compile_size"]
