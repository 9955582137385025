"""Whole-graph capture's per-call work: a call's signature, its entry, and the replay.

:class:`~fxrt.exec.capture.CaptureRunner` keeps what happens once per signature (warm-up counts,
captures, reports) and hands every call to a ``ReplayIndex``. The compiled loop's extension has
one in C++ (``fxrt/_speedups/replays.h``), which a capture with the compiled loop uses; this
module is its Python twin, which the Python loop uses and the tests hold the C++ one to. Both
run under the runner's lock.

A signature is the grad and inference modes and, per input, a tensor's dtype, device, layout,
sizes, strides and storage offset (not its storage's size: a copy that takes the whole storage
checks it), or any other input's type and value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def signature(inputs: Sequence[Any]) -> tuple:
    """The signature of ``inputs`` (see the module docstring)."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        *[_tensor_signature(x) if isinstance(x, torch.Tensor) else (type(x), x) for x in inputs],
    )


def _tensor_signature(x: torch.Tensor) -> tuple:
    if x.layout != torch.strided:
        return (x.dtype, x.device, x.layout, x.shape)
    return (x.dtype, x.device, x.layout, x.shape, x.stride(), x.storage_offset())


def on_storage(storage: torch.UntypedStorage, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A tensor with ``like``'s dtype, size and strides on ``storage`` at element ``offset``."""
    t = torch.empty(0, dtype=like.dtype, device=like.device)
    return t.set_(storage, offset, like.size(), like.stride())


class _Replay:
    def __init__(self, fixed, copies, replay, leaves, pool, clone, build):
        self.fixed = tuple(fixed)
        self.copies = tuple(copies)
        self.replay = replay
        self.leaves = tuple(leaves)
        self.pool = tuple(pool)
        self.clone = clone
        self.build = build


class ReplayIndex:
    """The signatures of one capture runner, by id in order of first sight, and the replays of
    those that hold a capture, on ``device``."""

    def __init__(self, device: torch.device):
        self.device = device
        self._ids: dict[tuple, int] = {}
        self._replays: list[_Replay | None] = []
        self._counts: list[int] = []
        self._previous: Any = None
        self.last_id = -1
        self.replayed = False
        self.moved = -1
        self.why = ""

    def find(self, inputs: Sequence[Any]) -> int:
        """The id of the signature of ``inputs``, or -1 when it has none yet."""
        return self._ids.get(signature(inputs), -1)

    def add(self, inputs: Sequence[Any]) -> int:
        """A new id for the signature of ``inputs``, which :meth:`find` does not know."""
        key = signature(inputs)
        if key in self._ids:
            raise ValueError("fxrt: this input signature already has an id")
        self._ids[key] = len(self._replays)
        self._replays.append(None)
        self._counts.append(0)
        return self._ids[key]

    def arm(
        self,
        id: int,
        fixed: Sequence[tuple[int, int]],
        copies: Sequence[tuple[int, torch.Tensor, bool]],
        replay: Callable[[], Any],
        leaves: Sequence[tuple],
        pool: Sequence[torch.Tensor],
        clone: bool,
        build: Callable[[list], Any],
    ) -> None:
        """Signature ``id`` holds a capture. Its replays read ``fixed`` inputs, ``(input,
        data_ptr)``, where they lie; copy each of ``copies``, ``(input, static buffer, whole)``,
        into its buffer (its whole storage with ``whole``); call ``replay()``; and make the
        outputs from ``leaves``: ``("value", object)``, ``("input", i, like)`` (a view of input
        i) or ``("pool", k, like)`` (a view of pool storage k, cloned per call with ``clone``),
        ``like`` a tensor with the output's dtype, sizes, strides and storage offset, and hand
        the list to ``build``."""
        self._check(id)
        self._replays[id] = _Replay(fixed, copies, replay, leaves, pool, clone, build)

    def disarm(self, id: int) -> None:
        """Signature ``id`` holds no capture (any more)."""
        self._check(id)
        self._replays[id] = None

    def call(self, inputs: Sequence[Any]) -> Any:
        """Replay when the signature of ``inputs`` holds a capture and every fixed input is where
        the capture read it, and return the outputs (:attr:`replayed` is then true). Otherwise
        return None, having run nothing, with :attr:`last_id` (the signature's id, or -1),
        :attr:`moved` (the input that moved, or -1) and :attr:`why` (``"changed address"``,
        ``"changed storage size"`` or ``""``) saying why."""
        self.last_id = self._ids.get(signature(inputs), -1)
        self.replayed, self.moved, self.why = False, -1, ""
        r = self._replays[self.last_id] if self.last_id >= 0 else None
        if r is None:
            return None
        for i, ptr in r.fixed:
            if inputs[i].data_ptr() != ptr:
                self.moved, self.why = i, "changed address"
                return None
        for i, static, whole in r.copies:
            if whole and inputs[i].untyped_storage().nbytes() != static.untyped_storage().nbytes():
                self.moved, self.why = i, "changed storage size"
                return None
        stream = torch.accelerator.current_stream(self.device)
        if self._previous is not None and stream != self._previous:
            stream.wait_stream(self._previous)
        self._previous = stream
        for i, static, whole in r.copies:
            if whole:
                static.untyped_storage().copy_(inputs[i].untyped_storage())
            else:
                static.copy_(inputs[i])
        r.replay()
        self.replayed = True
        self._counts[self.last_id] += 1
        clones = [b.clone().untyped_storage() for b in r.pool] if r.clone else None
        leaves = []
        for item in r.leaves:
            if item[0] == "value":
                leaves.append(item[1])
            else:
                kind, k, like = item
                storage = inputs[k].untyped_storage() if kind == "input" else clones[k]
                leaves.append(on_storage(storage, like, like.storage_offset()))
        return r.build(leaves)

    def replays(self, id: int) -> int:
        """How many replays signature ``id`` ran."""
        self._check(id)
        return self._counts[id]

    def clear(self) -> None:
        """Forget every signature."""
        self._ids.clear()
        self._replays.clear()
        self._counts.clear()
        self._previous = None

    def _check(self, id: int) -> None:
        if not 0 <= id < len(self._replays):
            raise IndexError(f"fxrt: no input signature has id {id}")


__all__ = ["ReplayIndex", "on_storage", "signature"]
