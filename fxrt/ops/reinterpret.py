"""``fxrt::reinterpret_tensor``: Inductor's ``reinterpret_tensor`` as a view op with a schema
that says so.

Inductor's host graphs make one view per weight and buffer they hand a kernel. Inductor's own
Python wrapper makes them with ``reinterpret_tensor``, a raw alias whose offset is relative to
its base's; its op form ``inductor::_reinterpret_tensor`` has no alias annotation, so AOTAutograd's
first-call check (``torch._functorch.config.check_custom_op_aliasing``) takes its result for an
illegal alias of its input: a warning, or an error where ``error_on_custom_op_aliasing`` is set
(the default when ``CI`` is set). This op has the same arguments and an annotated ``Tensor(a)``
result. Its kernel is ``as_strided`` at the base's offset plus the increment (composite, so
autograd, fake tensors and dispatch modes see only ``aten::as_strided``); fxrt's compiled loop
makes it inline on plain CPU tensors as a raw alias, as Inductor's wrapper does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_LIB = torch.library.Library("fxrt", "FRAGMENT")  # fxrt/_speedups adds its own ops
_LIB.define(
    "reinterpret_tensor(Tensor(a) self, SymInt[] size, SymInt[] stride, "
    "SymInt offset_increment=0) -> Tensor(a)"
)


def _reinterpret_tensor(
    self: torch.Tensor, size: Sequence[int], stride: Sequence[int], offset_increment: int = 0
) -> torch.Tensor:
    return self.as_strided(size, stride, self.storage_offset() + offset_increment)


_LIB.impl("reinterpret_tensor", _reinterpret_tensor, "CompositeImplicitAutograd")

reinterpret_tensor = torch.ops.fxrt.reinterpret_tensor.default

__all__ = ["reinterpret_tensor"]
