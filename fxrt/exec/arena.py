"""Arena planning: intermediates written into one preallocated buffer, reused from call to call.

Allocating each op's result costs more than many small ops themselves: a fresh ``TensorImpl``,
its storage and a ``malloc`` per op (measured with ``callBoxed`` on a 1x64 tensor: ``sin`` 1.0 us,
``sin.out`` into a kept tensor 0.6 us). Like Static Runtime, fxrt therefore gives the intermediates
it can a place in an arena and calls the op's ``out=`` overload there:

1. Candidates. A value gets a slot when it is a fresh storage (a lifetime-plan root) whose alias
   set is not pinned (no graph input, constant or output ever shares it), with static metadata,
   made by an ATen call that either allocates uninitialized memory (the ``empty`` family: no call
   at all, the slot is the result) or has an ``out=`` overload with a kernel of its own on the
   value's device and exactly the functional overload's arguments plus ``out`` (``relu`` uses
   ``clamp_min.out``, which is what ATen's relu calls). An op with several results
   (``max.dim``, ``fxrt::add_rms_norm``, ``fxrt::rotary``) gets a slot per result, side by
   side in slot order, when every result can have one (its ``out=`` form, one written argument
   per result, writes them all), else none. Random ops keep their functional call,
   so their generator draws stay those of eager. The arena is one buffer on one device: the one
   whose candidates hold the most bytes (the CPU on a tie); candidates on other devices keep
   their plain calls.
2. Intervals. A slot is busy from the node that makes its value to the node after which the
   lifetime plan frees the value's alias set (views of it extend it).
3. Offsets: greedy by size, as in Static Runtime and TFLite: largest first, each at the lowest
   64-byte aligned offset that overlaps no placed slot whose interval overlaps its own. The
   placed slots are indexed by interval (a segment tree over node indices,
   :mod:`fxrt.exec.intervals`), so finding those that overlap a new one in time costs O(log n)
   plus what it finds, not a scan of all of them. A chain of results written over one another in
   place (a pointwise op's result over an operand that dies at it, :mod:`fxrt.exec.inplace`) is
   placed as one item, busy from its first member's node to its last one's end.
   :func:`fxrt.exec.arena_verify.verify_arena` checks the result with a sweep over node
   indices, not a test of every pair of slots, so compiling stays near-linear in the graph's
   length.
4. Peak. The arena is held whole for all of a call, so a call's peak is the arena's size plus
   the most bytes allocated outside it at any node, which can be more than the lifetime plan's
   own peak when the two maxima fall at different nodes (a decoder's widest attention tensors
   in slots, its logits outside). Until it is at most ``CompilerConfig.arena_headroom`` (1/8
   by default) or one page above the plan's, results leave the arena one node at a time (their nodes
   allocate them again): of the nodes whose results are live where the slots hold the most,
   the one whose results raise the peak outside the arena the least, then the largest; while
   that does not raise the call's peak (the best arena met is kept). On decoders at one thread
   the slots given back cost no speed beyond noise, and they keep GLM's peak (its 128-wide
   heads' q and k in and out of the rotary in slots, its logits outside) under eager's.
5. Views made inline. On the same calls (no autograd), a view (``view``, ``_unsafe_view``, ``t``,
   ``transpose``, ``permute``, ``split``) whose values never leave the graph, are never written
   and are only read by ops that return fresh results, or by such views, needs no view tracking:
   the compiled loop makes it as the op's CPU kernel does (a new TensorImpl on the same
   storage, geometry computed from the actual input) without the dispatcher and autograd's view
   layer.
   :func:`fxrt.exec.views.inline_views` picks them.

At run time a loop takes an arena (one storage and a tensor per slot, made by
:meth:`ArenaPlan.allocate`) from a pool when a call starts and puts it back when the call returns,
so concurrent calls each have their own and no result a caller holds ever lives in one. A call
runs without the arena (the plain functional ops) when autograd could record it, since ``out=``
ops refuse inputs that require grad, or when an input's size or dtype is not the one the graph was
compiled for. The arena stays allocated between calls: ``CompilerConfig(arena=False)`` (or
``FXRT_ARENA=0``) turns it off.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir.graph import Graph, OpKind, Ref, ValueKind
from ..ops.aliasing import is_collective
from .inplace import takes_over as in_place_candidates
from .intervals import SlotIndex
from .plan import Plan
from .streams import shared_values

ALIGNMENT = 64  # bytes; what PyTorch's CPU allocator guarantees for every allocation
PAGE = 4096  # bytes; an arena raising a call's peak by less keeps every slot

# Ops whose result is uninitialized memory: an arena slot serves as the result with no call.
ALLOCATING_OPS = frozenset(
    {
        "aten::empty.memory_format",
        "aten::empty_strided",
        "aten::empty_like",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one value lives in the arena, and the tensor made there for it."""

    value: int  # the value id it holds
    offset: int  # bytes from the arena's start
    nbytes: int  # the value's storage bytes
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    first: int  # node index that makes the value
    last: int  # node index after which its alias set is freed
    # How the value's node writes it here (``arena_call``, decided once, when the slot is placed):
    # the ``out=`` overload and its arguments, ``out`` passed as the value's own register; None,
    # (), {} for an allocation, which takes the slot as it is.
    out_target: Any = field(default=None, compare=False)
    out_args: tuple[Any, ...] = field(default=(), compare=False)
    out_kwargs: dict[str, Any] = field(default_factory=dict, compare=False)
    # The value whose slot this one takes over in place at its first node (same bytes; see
    # fxrt.exec.inplace), or -1.
    takes_over: int = -1


@dataclass(frozen=True)
class ArenaPlan:
    """The arena of one compiled graph: its size and a slot per value placed in it (possibly
    none: a graph whose only gain on calls without autograd is its inline views)."""

    nbytes: int
    slots: tuple[Slot, ...]
    # Per graph input position with static tensor metadata: (shape, dtype) a call must match to
    # use the arena.
    input_guards: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]
    device: str = "cpu"  # where the buffer lives (every slot's value is on it)

    def slot_of(self) -> dict[int, int]:
        """Value id -> slot index."""
        return {s.value: i for i, s in enumerate(self.slots)}

    def allocate(self) -> list[torch.Tensor]:
        """One arena: a buffer of ``nbytes`` on the arena's device and one tensor per slot, in
        slot order.

        Each slot's tensor has a storage of its own that views its bytes of the buffer, so it
        looks like a fresh result: storage offset 0 (``as_strided`` offsets are absolute),
        storage size the value's, and not resizable (an ``out=`` kernel that would resize it
        fails, and the plain call runs instead)."""
        buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device).untyped_storage()
        tensors = []
        for s in self.slots:
            t = torch.empty(0, dtype=s.dtype, device=self.device)
            t.set_(buffer[s.offset : s.offset + s.nbytes], 0, s.shape, s.stride)
            tensors.append(t)
        return tensors

    def live_bytes(self, plan: Plan) -> list[int]:
        """``plan.live_bytes`` with the arena counted instead of the values it holds: the bytes
        held after each node when the arena is used (static plans only)."""
        if not all(isinstance(b, int) for b in plan.live_bytes):
            raise ValueError("live_bytes with an arena needs a static plan")
        inside = _in_slots(len(plan.live_bytes), self.slots)
        return [b - a + self.nbytes for b, a in zip(plan.live_bytes, inside)]

    def text(self, names: dict[int, str] | None = None) -> str:
        lines = [f"arena: {self.nbytes} bytes, {len(self.slots)} slots"]
        for i, s in enumerate(self.slots):
            name = names[s.value] if names else str(s.value)
            span = f"[{s.offset}, {s.offset + s.nbytes}) nodes {s.first}..{s.last}"
            line = f"  slot {i}: %{name} {span}"
            if s.takes_over >= 0:
                line += f" (in place of %{names[s.takes_over] if names else s.takes_over})"
            lines.append(line)
        return "\n".join(lines)


@functools.cache
def out_variant(op: torch._ops.OpOverload, device: str = "cpu") -> torch._ops.OpOverload | None:
    """The ``out=`` overload that computes what ``op`` does into given tensors on ``device`` (a
    device type), or None.

    It must take exactly ``op``'s arguments (names, types, kinds and defaults) plus one
    kwarg-only written tensor per tensor ``op`` returns (``Tensor(a!) out``; for several
    results, as many, in the order of the results, e.g. ``values, indices``), return them, and
    have a kernel of its own for the device (:func:`own_kernel`): the generated ``out=``
    overloads that call the functional op and copy its result would only add a copy (and an
    allocation).
    """
    schema = op._schema
    n = len(schema.returns)
    if n == 0 or not all(isinstance(r.type, torch.TensorType) for r in schema.returns):
        return None
    if any(r.alias_info is not None for r in schema.returns) or schema.is_mutable:
        return None
    if torch.Tag.nondeterministic_seeded in op.tags:
        return None
    want = [_arg_key(a) for a in schema.arguments]
    packet = op.overloadpacket
    for name in packet.overloads():
        cand = getattr(packet, name)
        args = cand._schema.arguments
        if len(args) != len(want) + n or [_arg_key(a) for a in args[: len(want)]] != want:
            continue
        outs = args[len(want) :]
        if len(cand._schema.returns) != n or not all(
            a.kwarg_only
            and isinstance(a.type, torch.TensorType)
            and a.alias_info is not None
            and a.alias_info.is_write
            for a in outs
        ):
            continue
        if own_kernel(cand.name(), device):
            return cand
    return None


def out_names(out: torch._ops.OpOverload) -> tuple[str, ...]:
    """The names of an :func:`out_variant`'s written arguments, in the order of its results."""
    n = len(out._schema.returns)
    return tuple(a.name for a in out._schema.arguments[-n:])


_COMPOSITE_KEYS = (
    "CompositeExplicitAutograd",
    "CompositeExplicitAutogradNonFunctional",
    "CompositeImplicitAutograd",
)


@functools.cache
def own_kernel(name: str, device: str) -> bool:
    """Whether op ``name`` has a kernel of its own on device type ``device``: one registered for
    the device's dispatch key, or, on a backend that serves the ops it has no kernel for through
    one fallback (PyTorch's OpenReg, fxrt's stand-in device), no composite kernel (which the
    dispatcher would pick over the fallback)."""
    key = torch._C._dispatch_key_for_device(device)
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, key):
        return True
    if device == "cpu" or not torch._C._dispatch_has_backend_fallback(
        getattr(torch._C.DispatchKey, key)
    ):
        return False
    return not any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k) for k in _COMPOSITE_KEYS)


def _arg_key(a: torch.Argument) -> tuple:
    return (a.name, str(a.type), a.kwarg_only, repr(a.default_value))


def _placeable(graph: Graph, vid: int) -> bool:
    v = graph.values[vid]
    meta = v.meta
    return (
        v.kind is ValueKind.TENSOR
        and meta is not None
        and meta.is_static
        and isinstance(meta.storage_nbytes, int)
        and meta.storage_nbytes > 0
        and meta.dtype not in _QUANTIZED
    )


def arena_call(graph: Graph, node: Any) -> tuple[Any, tuple, dict] | None:
    """How ``node`` writes its results into arena slots: ``(out= overload, args, kwargs)``
    whose kwargs pass each written argument (``out``; for several results, one per result) as
    that result's own register (the loop puts the slots' tensors there first), ``(None, (), {})``
    for an allocation, which needs no call, or None when it cannot."""
    if node.op.kind is not OpKind.ATEN or is_collective(node.op.name):
        return None
    if node.op.name in ALLOCATING_OPS:
        return None if node.kwargs.get("pin_memory") is True else (None, (), {})
    meta = graph.values[node.outputs[0]].meta
    device = "cpu" if meta is None else torch.device(meta.device).type
    if node.op.name == "aten::relu":
        # ATen's relu is clamp_min(self, 0) (it only refuses bool), and relu's own out=
        # overload is a generated one that copies.
        if meta.dtype is torch.bool or not own_kernel("aten::clamp_min.out", device):
            return None
        return torch.ops.aten.clamp_min.out, (node.args[0], 0), {"out": Ref(node.outputs[0])}
    out = out_variant(node.op.target, device)
    if out is None:
        return None
    names = out_names(out)
    if len(names) != len(node.outputs) or node.multi != (len(names) > 1):
        return None
    written = {name: Ref(v) for name, v in zip(names, node.outputs)}
    return out, node.args, {**node.kwargs, **written}


def plan_arena(
    graph: Graph, plan: Plan, views: frozenset[int] = frozenset(), headroom: float = 0.125
) -> ArenaPlan | None:
    """Place what can live in an arena (see the module docstring); None when nothing can and
    there are no inline ``views`` (node indices) either. ``headroom``: how far the arena may
    raise a call's peak above the lifetime plan's, as a fraction of it."""
    free_at = {v: i for i, vs in enumerate(plan.frees) for v in vs}
    items = []
    for i, node in enumerate(graph.nodes):
        # Every result of the node in a slot, or none (its out= form writes them all).
        vids = node.outputs
        if not vids or any(
            v not in plan.roots or v in plan.pinned or v not in free_at or not _placeable(graph, v)
            for v in vids
        ):
            continue
        call = arena_call(graph, node)
        if call is None:
            continue
        for vid in vids:
            meta = graph.values[vid].meta
            items.append((vid, int(meta.storage_nbytes), i, free_at[vid], call))
    by_device: dict[str, int] = {}
    for it in items:
        dev = graph.values[it[0]].meta.device
        by_device[dev] = by_device.get(dev, 0) + it[1]
    device = max(by_device, key=lambda d: (by_device[d], d == "cpu"), default="cpu")
    away = {it[2] for it in items if graph.values[it[0]].meta.device != device}  # their nodes
    items = [it for it in items if it[2] not in away]  # a node's results all placed, or none
    if not items and not views:
        return None
    shared = shared_values(graph)  # on side streams: busy over the whole program
    slots = _place(graph, items, shared)
    # The arena is held whole all call long: where it would raise a call's peak past the
    # lifetime plan's own and the headroom, results leave it (their nodes allocate them again)
    # while that lowers the peak.
    allowed = max(plan.peak_bytes * headroom, PAGE) if math.isfinite(headroom) else math.inf
    excess = _excess(plan, slots)
    best = (excess, slots)
    while excess > allowed:
        # A tie can take another step to an improvement (the widest moment inside the arena can
        # come twice), a rise cannot; the best arena met is kept, with the most slots.
        items = _evict(plan, items, slots)
        if items is None:
            break
        placed = _place(graph, items, shared)
        if (now := _excess(plan, placed)) > excess:
            break
        excess, slots = now, placed
        best = min(best, (excess, slots), key=lambda b: b[0])
    slots = best[1]
    guards = []
    for pos, vid in enumerate(graph.inputs):
        v = graph.values[vid]
        if v.kind is ValueKind.TENSOR and v.meta is not None and v.meta.is_static:
            guards.append((pos, tuple(v.meta.shape), v.meta.dtype))
    return ArenaPlan(
        nbytes=_arena_bytes(slots),
        slots=slots,
        input_guards=tuple(guards),
        device=device,
    )


def _place(graph: Graph, items: list[tuple], shared: Any) -> tuple[Slot, ...]:
    """Offsets for ``items`` (value, bytes, first node, last node, call): greedy by size, each
    chain of in-place results as one item; the slots in node order, a node's results side by
    side in the order of its outputs."""
    placed = SlotIndex(len(graph.nodes))
    whole = (0, max(len(graph.nodes) - 1, 0))
    for chain in sorted(_in_place_chains(graph, items, shared), key=lambda c: (-c[0][1], c[0][2])):
        nbytes = chain[0][1]
        since, until = whole if chain[0][0] in shared else (chain[0][2], chain[-1][3])
        offset = 0
        busy = sorted((s.offset, s.offset + s.nbytes) for s in placed.overlapping(since, until))
        for lo, hi in busy:
            if offset + nbytes <= lo:
                break
            offset = max(offset, _align(hi))
        before = -1
        for vid, _, first, last, call in chain:
            meta = graph.values[vid].meta
            shape, stride = tuple(meta.shape), tuple(meta.stride)
            slot = Slot(vid, offset, nbytes, shape, stride, meta.dtype, first, last, *call, before)
            placed.add(slot, *(whole if vid in shared else (first, last)))
            before = vid
    position = {v: k for n in graph.nodes if len(n.outputs) > 1 for k, v in enumerate(n.outputs)}
    return tuple(sorted(placed.slots, key=lambda s: (s.first, position.get(s.value, 0))))


def _arena_bytes(slots: tuple[Slot, ...]) -> int:
    return _align(max((s.offset + s.nbytes for s in slots), default=0))


def _in_slots(n: int, slots: tuple[Slot, ...]) -> list[int]:
    """Per node, the bytes of the slots whose values are live there."""
    delta = [0] * (n + 1)
    for s in slots:
        lo, hi = max(s.first, 0), min(s.last, n - 1)
        if lo <= hi:
            delta[lo] += s.nbytes
            delta[hi + 1] -= s.nbytes
    return list(itertools.accumulate(delta[:n]))


def _excess(plan: Plan, slots: tuple[Slot, ...]) -> int:
    """By how many bytes the arena raises a call's peak above the lifetime plan's own: the arena
    is held whole all call long, so a call's peak is its size plus the most bytes held outside
    it at any node (0 for a plan with sizes only known at run time)."""
    if plan.symbolic or not plan.live_bytes:
        return 0
    inside = _in_slots(len(plan.live_bytes), slots)
    outside = max(b - a for b, a in zip(plan.live_bytes, inside))
    return _arena_bytes(slots) + outside - plan.peak_bytes


def _evict(plan: Plan, items: list[tuple], slots: tuple[Slot, ...]) -> list[tuple] | None:
    """``items`` less one node's results (all of them), or None when no node's results are live
    where the slots hold the most bytes. Of those that are, the node whose results, allocated
    outside the arena instead, raise the peak outside it the least; then the one with the most
    bytes there."""
    inside = _in_slots(len(plan.live_bytes), slots)
    widest = max(inside)
    at = [i for i, b in enumerate(inside) if b == widest]
    outside = [b - a for b, a in zip(plan.live_bytes, inside)]
    top = max(outside)
    spans: dict[int, tuple[int, int, int]] = {}  # node -> (bytes, first, last) of its results
    for _, nbytes, first, last, _ in items:
        b, lo, hi = spans.get(first, (0, first, last))
        spans[first] = (b + nbytes, lo, max(hi, last))
    scores = []
    for node, (nbytes, lo, hi) in spans.items():
        if any(lo <= i <= hi for i in at):
            rise = max(0, max(outside[lo : hi + 1]) + nbytes - top)
            scores.append((rise, -nbytes, node))
    if not scores:
        return None
    gone = min(scores)[2]
    return [it for it in items if it[2] != gone]


def _in_place_chains(graph: Graph, items: list[tuple], shared: Any) -> list[list[tuple]]:
    """``items`` (value, bytes, first node, last node, call) grouped in chains, in node order:
    each member after the first is written over the one before it in place, at its first node,
    where that one's slot ends (:func:`fxrt.exec.inplace.takes_over`); values on side streams
    stay alone, and so do a node's several results."""
    by_value = {it[0]: it for it in items}
    made_by = {v: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    chain_of: dict[int, list[tuple]] = {}
    chains = []
    for it in sorted(items, key=lambda it: it[2]):
        vid, first = it[0], it[2]
        chain = None
        if vid not in shared and len(graph.nodes[first].outputs) == 1:  # a single result
            for owner in in_place_candidates(graph, made_by, first):
                before = by_value.get(owner)
                # Equal bytes: a dense operand with as many bytes as its owner's storage is all
                # of it, from its first byte (a view's metadata does not say its offset).
                ok = before is not None and before[1] == it[1] and before[3] == first
                if ok and owner not in shared:
                    c = chain_of[owner]
                    if c[-1][0] == owner:  # nothing took it over yet
                        chain = c
                        break
        if chain is None:
            chain = []
            chains.append(chain)
        chain.append(it)
        chain_of[vid] = chain
    return chains


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


__all__ = [
    "ALLOCATING_OPS",
    "ArenaPlan",
    "Slot",
    "arena_call",
    "out_names",
    "out_variant",
    "own_kernel",
    "plan_arena",
]
