"""A package's weights: their manifest records checked against the tensor file's entries, and the
tensors made on the mapped file's storage (one storage per entry, so tied names share memory)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import package
from .package import PackageError
from .tensorfile import DTYPES

_WEIGHT_KEYS = {"entry", "dtype", "shape", "stride", "offset", "kind"}
_WEIGHT_KINDS = ("parameter", "buffer", "nonpersistent_buffer", "constant")


def _fail(msg: str) -> PackageError:
    return PackageError(f"invalid fxrt package: {msg}")


def weight_records(weights: dict[str, Any], entries: dict[str, Any]) -> dict[str, Any]:
    for name, r in weights.items():
        where = f"weight {name[:60]!r}"
        if len(name) > 4096 or not isinstance(r, dict) or set(r) != _WEIGHT_KEYS:
            raise _fail(f"{where}: malformed")
        e = entries.get(r["entry"]) if isinstance(r["entry"], str) else None
        if e is None:
            raise _fail(f"{where}: no weights entry {str(r['entry'])[:60]!r}")
        if r["kind"] not in _WEIGHT_KINDS:
            raise _fail(f"{where}: unknown kind")
        if r["dtype"] != DTYPES[e.dtype][0]:
            raise _fail(f"{where}: dtype {str(r['dtype'])[:20]} but its entry is {e.dtype}")
        shape, stride, offset = r["shape"], r["stride"], r["offset"]
        ints = (
            [*shape, *stride, offset]
            if isinstance(shape, list) and isinstance(stride, list)
            else [None]
        )
        if (
            len(shape) != len(stride)
            or len(shape) > 64
            or not all(type(i) is int and 0 <= i < 2**62 for i in ints)
        ):
            raise _fail(f"{where}: malformed geometry")
        numel = 1
        for s in shape:
            numel *= s
        if numel and offset + sum((s - 1) * st for s, st in zip(shape, stride)) >= e.numel:
            raise _fail(f"{where}: view reaches past its entry")
    return weights


def weight_tensors(
    raw: package.RawPackage, records: dict[str, Any], device: torch.device
) -> dict[str, torch.Tensor]:
    """Each weight on the storage of its entry in the mapped file (one storage per entry, so tied
    names share memory), on ``device``.

    A weight is a tensor of its own set on that storage (``set_``), as a module's parameter is,
    not an autograd view of the entry (``as_strided``): it has no view bookkeeping, and the load
    does not run autograd's view-tracking code (about 0.6 MiB of torch's code paged in at the
    first load of a process, most of which a call does not run)."""
    bases: dict[str, torch.Tensor] = {}
    views: dict[Any, torch.Tensor] = {}
    out = {}
    for name, r in records.items():
        e = raw.entries[r["entry"]]
        base = bases.get(e.name)
        if base is None:
            dtype = getattr(torch, DTYPES[e.dtype][0])
            if e.numel:
                base = torch.frombuffer(
                    raw.buf, dtype=dtype, count=e.numel, offset=raw.data_start + e.begin
                )
            else:
                base = torch.empty(0, dtype=dtype)
            if base.device != device:
                base = base.to(device)
            bases[e.name] = base
        key = (e.name, tuple(r["shape"]), tuple(r["stride"]), r["offset"])
        t = views.get(key)
        if t is None:
            t = views[key] = torch.empty(0, dtype=base.dtype, device=base.device).set_(
                base.untyped_storage(), base.storage_offset() + r["offset"], r["shape"], r["stride"]
            )
        out[name] = t
    return out


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (
        a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(str(s) for s in t.shape)}]"


def updated_weights(
    current: dict[str, torch.Tensor],
    state_dict: Mapping[str, torch.Tensor],
    ties: dict[str, tuple[str, ...]],
    kinds: dict[str, str],
    strict: bool,
) -> dict[str, torch.Tensor]:
    """``current`` with the tensors of ``state_dict`` in place (see ``LoadedModel.update_weights``):
    each checked against the weight it replaces, copied to its device and strides where they
    differ, tied names given one tensor."""
    unknown = sorted(k for k in state_dict if k not in current)
    if unknown and strict:
        raise ValueError(f"fxrt: update_weights: unknown weights {unknown[:10]}")
    chosen: dict[tuple[str, ...], tuple[str, torch.Tensor, torch.Tensor]] = {}
    for name, t in state_dict.items():
        if name not in current:
            continue
        old = current[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fxrt: weight '{name}': expected a tensor, got {type(t).__name__}")
        if t.shape != old.shape or t.dtype != old.dtype:
            raise ValueError(
                f"fxrt: weight '{name}': the package has {describe(old)}, got {describe(t)} "
                "(shapes and dtypes must match: the graph is not recompiled)"
            )
        new = t.detach()
        if new.device != old.device or new.stride() != old.stride():
            new = torch.empty_strided(
                old.shape, old.stride(), dtype=old.dtype, device=old.device
            ).copy_(new)
        group = ties[name]
        if group in chosen and not same_tensor(chosen[group][1], t):
            raise ValueError(
                f"fxrt: weights '{chosen[group][0]}' and '{name}' are tied in the package "
                "(one tensor) but were given different tensors"
            )
        chosen.setdefault(group, (name, t, new))
    if strict:
        missing = sorted(
            n for n in current if ties[n] not in chosen and kinds.get(n) in ("parameter", "buffer")
        )
        if missing:
            raise ValueError(f"fxrt: update_weights: missing weights {missing[:10]}")
    updated = dict(current)
    for group, (_, _, new) in chosen.items():
        for n in group:
            updated[n] = new
    return updated
