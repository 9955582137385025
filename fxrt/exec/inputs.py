"""What a compiled graph checks about its inputs on every call.

A graph is compiled for inputs of certain dtypes, devices, ranks, sizes and strides. Called with
anything else it would compute a wrong value (a mean over 6 rows applied to 5) or fail deep inside
an op. So every call checks each tensor input against its :class:`InputSpec`: dtype, device and
rank always; each static size exactly; each symbolic size that is a bare symbol (``s0``)
consistently across inputs (one symbol, one value); and each stride whose dimension has a static
size above 1 (a stride of a size-1 dimension addresses nothing). A tensor with symbolic sizes
whose strides say it was dense in some dimension order (contiguous, or a permutation of it:
:func:`dense_order`) must be dense in that order; its strides are encoded -2 - k, k the
dimension's place from the innermost. A mismatch raises
:class:`InputError` naming the input and both signatures. Both loops check the same specs (the
compiled loop in C++, about 0.1 us an input); ``check_inputs=False`` turns the check off for
callers that guarantee their inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ir.graph import Graph, TensorMeta, ValueKind

ANY = -1  # a size or stride not checked; symbols are encoded as -2 - k


class InputError(ValueError):
    """A compiled graph was called with an input it was not compiled for."""


@dataclass(frozen=True)
class InputSpec:
    pos: int  # the input's position in the call
    name: str
    meta: TensorMeta
    sizes: tuple[int, ...]  # >= 0 exact, ANY, or -2 - k for size symbol k
    strides: tuple[int, ...]  # >= 0 exact, ANY, or -2 - k: dense, k-th from the innermost
    device: torch.device  # meta.device, resolved once rather than per call
    dense: tuple[int, ...] = ()  # with strides -2 - k: the dimensions, innermost first

    def describe(self) -> str:
        dt = str(self.meta.dtype).removeprefix("torch.")
        dims = ", ".join(str(s) for s in self.meta.shape)
        dev = "" if self.meta.device == "cpu" else f"@{self.meta.device}"
        stride = ", ".join(str(s) for s in self.meta.stride)
        return f"{dt}[{dims}]{dev} stride ({stride})"


def input_specs(graph: Graph) -> tuple[InputSpec, ...]:
    """One spec per tensor input whose metadata is known."""
    symbols: dict[str, int] = {}
    specs = []
    for pos, vid in enumerate(graph.inputs):
        v = graph.values[vid]
        if v.kind is not ValueKind.TENSOR or v.meta is None:
            continue
        sizes = []
        for s in v.meta.shape:
            if isinstance(s, int):
                sizes.append(s)
            elif isinstance(s, str) and s.isidentifier():
                sizes.append(-2 - symbols.setdefault(s, len(symbols)))
            else:
                sizes.append(ANY)
        order = None if v.meta.is_static else dense_order(v.meta)
        if order is not None:
            strides = tuple(-2 - order.index(d) for d in range(len(order)))
        else:
            order = []
            strides = tuple(
                st if isinstance(st, int) and isinstance(sz, int) and sz > 1 else ANY
                for sz, st in zip(v.meta.shape, v.meta.stride)
            )
        device = torch.device(v.meta.device)
        specs.append(InputSpec(pos, v.name, v.meta, tuple(sizes), strides, device, tuple(order)))
    return tuple(specs)


def dense_order(meta: TensorMeta) -> list[int] | None:
    """The dimensions of a symbolic-size tensor from innermost to outermost, when its strides
    say it is dense in that order (contiguous, or a permutation of contiguous), else None.
    Compared symbolically: stride (s1, 1) of shape (s0, s1) is dense in the order [1, 0]."""
    import sympy

    try:
        sizes = [sympy.sympify(s) for s in meta.shape]
        strides = [sympy.sympify(s) for s in meta.stride]
    except (sympy.SympifyError, TypeError):
        return None
    order: list[int] = []
    expected = sympy.Integer(1)
    # A dimension of size 1 addresses nothing: its stride says nothing, it goes anywhere.
    ones = [d for d in range(len(sizes)) if sizes[d] == 1]
    left = [d for d in range(len(sizes)) if d not in ones]
    while left:
        d = next((d for d in left if sympy.expand(strides[d] - expected) == 0), None)
        if d is None:
            return None
        order.append(d)
        left.remove(d)
        expected = expected * sizes[d]
    return order + ones


def describe_input(x: Any) -> str:
    if not isinstance(x, torch.Tensor):
        return f"a {type(x).__name__}"
    dt = str(x.dtype).removeprefix("torch.")
    dev = "" if x.device.type == "cpu" else f"@{x.device}"
    stride = ", ".join(str(s) for s in x.stride())
    return f"{dt}[{', '.join(str(s) for s in x.shape)}]{dev} stride ({stride})"


def mismatch(spec: InputSpec, x: Any, why: str = "") -> InputError:
    return InputError(
        f"input {spec.pos} '{spec.name}': compiled for {spec.describe()}, got {describe_input(x)}"
        + (f" ({why})" if why else "")
        + "; compile again for these inputs, or pass check_inputs=False if the graph is known "
        "to handle them"
    )


def check_inputs(specs: Sequence[InputSpec], inputs: Sequence[Any]) -> None:
    """Raise :class:`InputError` for the first input that does not match its spec. Reads
    tensor metadata with ``__torch_function__`` off: a mode or subclass sees only the graph's
    ops, as in the compiled loop."""
    with torch._C.DisableTorchFunction():
        _check(specs, inputs)


def _check(specs: Sequence[InputSpec], inputs: Sequence[Any]) -> None:
    bound: dict[int, int] = {}
    for spec in specs:
        x = inputs[spec.pos]
        if (
            not isinstance(x, torch.Tensor)
            or x.dtype != spec.meta.dtype
            or x.device != spec.device
            or x.dim() != len(spec.sizes)
        ):
            raise mismatch(spec, x)
        for want, got in zip(spec.sizes, x.shape):
            if want >= 0:
                if got != want:
                    raise mismatch(spec, x)
            elif want != ANY and bound.setdefault(want, got) != got:
                raise mismatch(spec, x, "a size symbol bound to two values")
        strides = x.stride()
        if spec.dense:
            expected = 1
            for d in spec.dense:
                size = x.shape[d]
                if size != 1 and strides[d] != expected:
                    raise mismatch(spec, x, "not dense in the layout it was compiled for")
                expected *= size
            continue
        for want, got in zip(spec.strides, strides):
            if want >= 0 and got != want:
                raise mismatch(spec, x)


__all__ = ["ANY", "InputError", "InputSpec", "check_inputs", "input_specs", "mismatch"]
