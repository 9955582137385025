"""Whole-graph capture: ``mode="reduce-overhead"`` (or ``options={"capture": True}``).

On a device with a graph API (CUDA graphs, Ascend's NPUGraph, any device that offers the same
names: :mod:`fxrt.exec.device_graphs`), a compiled graph records every launch of one run of its
Program into a device graph, once per input signature, and later calls replay that graph with
one host call. Per call, :class:`CaptureRunner`:

1. Runs the loop when capture cannot serve the call: ``force_eager``; a graph on the CPU or with
   a reason found before any capture (:func:`capture_blockers`: a host read of device data, a
   data-dependent shape, a CPU tensor, a Python fallback that reads tensors); autograd could
   record the call; ``__torch_function__`` or a dispatch mode must see its ops; a profile is
   being recorded; past ``capture_limit`` signatures.
2. Keys the call by its signature: each tensor input's size, strides, dtype, device and storage
   layout, each other input's value, and the grad and inference modes. The first
   ``capture_warmup`` calls of a signature run the loop (lazy initialization happens there).
3. Captures. Each tensor input is either *fixed* (a parameter, an input the graph writes, an
   input whose address did not change over the warmup calls, and every input with
   ``clone_input`` off: the graph reads it where it lies, so its address is part of the capture)
   or *copied* into a static buffer of the same storage layout, made once per signature. One run
   of the Program is captured on a side stream into a graph whose memory comes from the compiled
   graph's pool (``use_graph_pool`` or one of its own, shared by its signatures): the
   intermediates, the outputs and the arena, which a separate loop that keeps no arena between
   calls allocates during the capture. The graph is then replayed for this call's result.
4. Replays. A fixed input at another address recaptures (counted and logged; an input that moved
   and that the graph does not write is copied from then on). Copied inputs are copied in, the
   graph replays on the current stream, and the outputs are returned.

Outputs. With ``clone_output`` (the default) every call returns new tensors: each output storage
in the pool is cloned once (outputs that share a storage still share their clone). Without it,
the outputs are the pool's tensors, and **the next call of any graph sharing the pool overwrites
them** (the signatures of one compiled graph share one pool). Outputs that alias an input are
views of the caller's input, as in eager, either way.

Replays of one compiled graph are serialized (a lock, and a call from another stream than the
previous replay's waits for that stream), so threads may share it.

What every call does (the signature, its lookup, and a replay: the fixed inputs' addresses, the
copies, the stream, the replay and the outputs) is a ``ReplayIndex``: with the compiled loop the
extension's C++ one, else its Python twin (:mod:`fxrt.exec.replays`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..analysis.streams import has_stream_ops
from ..ir.graph import Graph
from .capturable import RegionRunner, mutated_inputs, node_blockers, split_regions
from .capture_report import CaptureReport, SignatureReport, copy_report
from .device_graphs import GraphAPI, graph_api
from .guards import fills_uninitialized_memory, torch_function_active
from .program import Program
from .replays import ReplayIndex, on_storage

log = logging.getLogger("fxrt")


class _Entry:
    """One signature's state."""

    def __init__(self, id: int, report: SignatureReport, inputs: Sequence[Any]):
        self.id = id  # in the runner's ReplayIndex
        self.report = report
        self.calls = 0
        self.ptrs = [x.data_ptr() if isinstance(x, torch.Tensor) else None for x in inputs]
        self.stable = [p is not None for p in self.ptrs]  # same address on every call so far
        self.moved: set[int] = set()  # fixed inputs that changed address: copied from now on
        self.graph: Any = None
        self.fixed: tuple[tuple[int, int], ...] = ()  # (input, data_ptr) replay reads in place
        self.copies: tuple[tuple[int, torch.Tensor, bool], ...] = ()  # (input, static, whole)
        self.outputs: Any = None  # (spec, leaves plan) see CaptureRunner._plan_outputs
        self.pool_buffers: tuple[torch.Tensor, ...] = ()

    def observe(self, inputs: Sequence[Any]) -> None:
        for i, x in enumerate(inputs):
            if self.stable[i] and x.data_ptr() != self.ptrs[i]:
                self.stable[i] = False


def _describe(inputs: Sequence[Any]) -> str:
    """The signature for people: the inputs that are not parameters, by position."""
    parts = []
    for i, x in enumerate(inputs):
        if isinstance(x, torch.nn.Parameter):
            continue
        if isinstance(x, torch.Tensor):
            dt = str(x.dtype).removeprefix("torch.")
            parts.append(f"{i}: {dt}[{', '.join(map(str, x.shape))}]")
        else:
            parts.append(f"{i}: {x!r}")
    return "(" + ", ".join(parts) + ")"


def _static_buffer(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A tensor with ``x``'s storage layout on a storage of its own, and whether a copy must
    take the whole storage (the view does not cover it densely)."""
    nbytes = x.untyped_storage().nbytes()
    storage = torch.empty(nbytes, dtype=torch.uint8, device=x.device).untyped_storage()
    whole = not (
        x.storage_offset() == 0 and x.is_contiguous() and x.numel() * x.element_size() == nbytes
    )
    return on_storage(storage, x, x.storage_offset()), whole


class CaptureRunner:
    """Runs a compiled graph's calls through device-graph capture and replay (see the module
    docstring). ``loop`` runs a call op by op; ``make_capture_loop()`` builds the loop that
    captures (one that keeps no arena between calls); ``make_index(device)`` the call's
    :class:`~fxrt.exec.replays.ReplayIndex`."""

    def __init__(
        self,
        name: str,
        graph: Graph,
        program: Program,
        config: Any,
        loop: Callable[[Sequence[Any]], Any],
        make_capture_loop: Callable[[], Callable[[Sequence[Any]], Any]],
        make_region: Callable[[Graph, bool], Any],
        make_index: Callable[[torch.device], Any] = ReplayIndex,
    ):
        self.name = name
        self.graph = graph
        self.program = program
        self.config = config
        self.loop = loop
        self._make_capture_loop = make_capture_loop
        self._make_region = make_region
        self._regions: RegionRunner | None = None
        self._capture_loop: Callable[[Sequence[Any]], Any] | None = None
        self._lock = threading.Lock()
        self._make_index = make_index
        self._index: Any = None  # made with the device, on the first call that may capture
        self._order: list[_Entry] = []  # by id
        self._reason = "force_eager is set" if config.force_eager else ""
        self._blockers: dict[int, str] | None = None
        self._mutated: frozenset[int] | None = None
        self._api: GraphAPI | None = None
        self._pool: Any = None
        self._stream: Any = None
        self._constant_storages = {
            obj.untyped_storage().data_ptr()
            for obj in graph.constants.values()
            if isinstance(obj, torch.Tensor) and obj.layout == torch.strided
        }

    # -- per call ---------------------------------------------------------------------------

    def __call__(self, inputs: Sequence[Any]) -> Any:
        if self._reason or not self._may_capture(inputs):
            return self.loop(inputs)
        if self._regions is not None:
            return self._regions(inputs)
        index = self._index
        with self._lock:
            out = index.call(inputs)
            if index.replayed:
                return out
            entry = self._order[index.last_id] if index.last_id >= 0 else None
            if index.moved >= 0:
                return self._recapture(entry, inputs, index.moved, index.why)
            if entry is None and self.config.capture_warmup == 0:
                entry = self._new_entry(inputs)
            ready = entry is not None and entry.calls >= self.config.capture_warmup
            if ready and not self._reason and not entry.report.reason:
                return self._capture(entry, inputs)
        out = self.loop(inputs)  # bad inputs raise here, before a signature is kept
        with self._lock:
            found = index.find(inputs)
            entry = self._order[found] if found >= 0 else self._new_entry(inputs)
            if entry is not None:
                entry.observe(inputs)
                entry.calls += 1
                entry.report.loop_calls += 1
        return out

    def _may_capture(self, inputs: Sequence[Any]) -> bool:
        if torch._C._len_torch_dispatch_stack() or torch_function_active(inputs):
            return False
        if fills_uninitialized_memory():
            return False
        if torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in inputs
        ):
            return False
        if self._index is None:
            with self._lock:
                return self._index is not None or self._find_device(inputs)
        return True

    def _find_device(self, inputs: Sequence[Any]) -> bool:
        """On the first call: the device the graph runs on, its graph API and the index."""
        devices = [x.device for x in inputs if isinstance(x, torch.Tensor)]
        if not devices:
            self._disable("the graph has no tensor input to say which device it runs on")
            return False
        device = next((d for d in devices if d.type != "cpu"), devices[0])
        api = graph_api(device.type)
        if isinstance(api, str):
            self._disable(api)
            return False
        self._api = api
        self._device = device
        self._index = self._make_index(device)
        return True

    def _new_entry(self, inputs: Sequence[Any]) -> _Entry | None:
        if len(self._order) >= self.config.capture_limit:
            self._disable(f"more than capture_limit={self.config.capture_limit} input signatures")
            return None
        entry = _Entry(self._index.add(inputs), SignatureReport(_describe(inputs)), inputs)
        assert entry.id == len(self._order)
        self._order.append(entry)
        return entry

    def _disable(self, reason: str) -> None:
        """The whole graph runs the loop from now on; its captures are released."""
        if not self._reason:
            self._reason = reason
            log.warning("fxrt capture: %s runs op by op from now on: %s", self.name, reason)
        for entry in self._order:
            self._index.disarm(entry.id)
            entry.graph = None
            entry.report.captured = False
        self._pool = None

    # -- capture ----------------------------------------------------------------------------

    def _capture(self, entry: _Entry, inputs: Sequence[Any]) -> Any:
        report = entry.report
        if self._blockers is None:
            self._blockers = node_blockers(self.graph, self.program)
            self._mutated = mutated_inputs(self.graph)
            if self._blockers:
                self._split()
        if self._regions is not None:
            return self._regions(inputs)
        if self._reason:
            report.loop_calls += 1
            return self.loop(inputs)
        api = self._api
        if self._pool is None:
            use = self.config.use_graph_pool
            self._pool = use if use is not None else api.pool_handle()
        if self._stream is None:
            self._stream = api.new_stream(self._device)
        if self._capture_loop is None:
            self._capture_loop = self._make_capture_loop()
        fixed, copies, run_inputs = [], [], list(inputs)
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                continue
            if self._fixed(entry, i, x):
                fixed.append((i, x.data_ptr()))
            else:
                static, whole = _static_buffer(x)
                copies.append((i, static, whole))
                run_inputs[i] = static
        entry.copies = tuple(copies)
        self._copy_in(entry, inputs)
        g = api.new_graph()
        try:
            with api.capture(g, self._pool, self._stream):
                outs = self._capture_loop(run_inputs)
        except Exception as e:  # a capture the device refused: this signature runs the loop
            report.reason = "the device refused the capture: " + _first_cause(e)
            log.warning("fxrt capture: %s %s: %s", self.name, report.signature, report.reason)
            entry.copies = ()
            report.loop_calls += 1
            return self.loop(inputs)
        entry.graph = g
        entry.fixed = tuple(fixed)
        entry.outputs = self._plan_outputs(outs, run_inputs)
        entry.pool_buffers = entry.outputs[2]
        report.captured = True
        report.captures += 1
        report.copied_inputs = tuple(i for i, _, _ in copies)
        report.fixed_inputs = tuple(i for i, _ in fixed)
        log.info("fxrt capture: %s captured %s", self.name, report.signature)
        self._arm(entry)
        out = self._index.call(inputs)  # the first replay
        assert self._index.replayed, "a signature just captured replays"
        return out

    def _arm(self, entry: _Entry) -> None:
        """Hand the capture of ``entry`` to the index, which replays it from now on."""
        spec, plan, pool = entry.outputs
        clone = self.config.clone_output
        leaves = [
            ("value", item[1]) if item[0] in ("value", "const")
            else ("value", item[2]) if item[0] == "pool" and not clone
            else item
            for item in plan
        ]  # fmt: skip
        self._index.arm(
            entry.id,
            list(entry.fixed),
            list(entry.copies),
            entry.graph.replay,
            leaves,
            list(pool),
            clone,
            _builder(spec),
        )

    def _split(self) -> None:
        """Some nodes cannot be captured: capture the regions between them (or, when no node
        can be, run the loop)."""
        blocked = self._blockers
        reasons = list(blocked.values())
        if has_stream_ops(self.graph):  # regions would cut its scopes and events apart
            self._disable("a multi-stream graph is captured whole or not at all: " + reasons[0])
            return
        if len(blocked) == len(self.graph.nodes):
            more = len(reasons) - 1
            self._disable(reasons[0] + (f" (and {more} more)" if more else ""))
            return
        regions = split_regions(self.graph, blocked)
        self._regions = RegionRunner(self.graph, self.program, regions, self._make_region)
        log.info(
            "fxrt capture: %s is captured in %d regions around what cannot be: %s",
            self.name,
            len(regions),
            "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else ""),
        )
        for entry in self._order:  # the signatures seen so far belong to the whole graph
            entry.report.reason = "the graph runs in regions"

    def _fixed(self, entry: _Entry, i: int, x: torch.Tensor) -> bool:
        if not self.config.clone_input or i in self._mutated:
            return True
        if i in entry.moved or x.untyped_storage().data_ptr() in self._pool_storages():
            return False
        return isinstance(x, torch.nn.Parameter) or (
            entry.stable[i] and entry.calls > 0 and x.data_ptr() == entry.ptrs[i]
        )

    def _pool_storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for e in self._order for t in e.pool_buffers}

    def _plan_outputs(self, outs: Any, run_inputs: Sequence[Any]) -> Any:
        """How each call builds its outputs from the capture's: per leaf, ``("value", v)``,
        ``("const", t)``, ``("input", i, t)`` (a view of input i: rebuilt on the caller's
        tensor) or ``("pool", k, t)`` (a view of pool storage k)."""
        leaves, spec = tree_flatten(outs)
        by_storage = {
            x.untyped_storage().data_ptr(): i
            for i, x in enumerate(run_inputs)
            if isinstance(x, torch.Tensor)
        }
        buffers: dict[int, int] = {}
        pool: list[torch.Tensor] = []
        plan = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                plan.append(("value", leaf))
                continue
            ptr = leaf.untyped_storage().data_ptr()
            if ptr in by_storage:
                plan.append(("input", by_storage[ptr], leaf))
            elif ptr in self._constant_storages:
                plan.append(("const", leaf))
            else:
                if ptr not in buffers:
                    buffers[ptr] = len(pool)
                    storage = leaf.untyped_storage()
                    pool.append(torch.empty(0, dtype=torch.uint8, device=leaf.device).set_(storage))
                plan.append(("pool", buffers[ptr], leaf))
        return spec, tuple(plan), tuple(pool)

    # -- replay -----------------------------------------------------------------------------

    def _copy_in(self, entry: _Entry, inputs: Sequence[Any]) -> None:
        for i, static, whole in entry.copies:
            x = inputs[i]
            if whole:
                static.untyped_storage().copy_(x.untyped_storage())
            else:
                static.copy_(x)

    def _recapture(
        self, entry: _Entry, inputs: Sequence[Any], moved: int, why: str = "changed address"
    ) -> Any:
        report = entry.report
        if report.captures >= self.config.capture_limit:
            report.reason = f"input {moved} {why} {report.captures} times"
            report.captured = False
            self._index.disarm(entry.id)
            entry.graph = None
            report.loop_calls += 1
            return self.loop(inputs)
        if moved not in self._mutated and why == "changed address":
            entry.moved.add(moved)
        log.info(
            "fxrt capture: %s %s: input %d %s; recapturing",
            self.name,
            report.signature,
            moved,
            why,
        )
        self._index.disarm(entry.id)
        entry.graph.reset()
        entry.graph = entry.outputs = None
        entry.pool_buffers = ()
        return self._capture(entry, inputs)

    # -- the compiled graph's API -----------------------------------------------------------

    def report(self) -> CaptureReport:
        with self._lock:
            for e in self._order:
                e.report.replays = self._index.replays(e.id)
            report = CaptureReport(
                self.name, True, self._reason, [copy_report(e.report) for e in self._order]
            )
        if self._regions is not None:
            report.regions = self._regions.report()
        return report

    def release(self) -> None:
        """Free the captures and the pool; later calls capture again."""
        with self._lock:
            for entry in self._order:
                if entry.graph is not None:
                    entry.graph.reset()
            if self._index is not None:
                self._index.clear()
            self._order.clear()
            self._pool = None
            self._capture_loop = None
            if self._regions is not None:
                self._regions.release()


def _builder(spec: Any) -> Callable[[list], Any]:
    """What makes a call's outputs from the list of their leaves: ``tuple`` or ``list`` for a
    tuple or list of leaves (as Dynamo's graphs return), else the structure's own unflatten."""
    children = range(spec.num_children)
    if spec.type in (tuple, list) and all(spec.child(i).is_leaf() for i in children):
        return spec.type
    return spec.unflatten


def _first_cause(e: BaseException) -> str:
    """The innermost error of a failed capture (what the failing node raised, which names it),
    then what the device said when the capture ended."""
    chain = [e]
    while chain[-1].__context__ is not None and len(chain) < 8:
        chain.append(chain[-1].__context__)
    lines = [
        f"{type(x).__name__}: {(str(x).strip().splitlines() or [''])[0]}" for x in reversed(chain)
    ]
    return "; then ".join(lines)


__all__ = ["CaptureReport", "CaptureRunner", "SignatureReport"]
