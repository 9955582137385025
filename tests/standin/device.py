"""The stand-in's device module, registered as ``torch.<name>`` (``torch.fxrt_standin``): the
subset of ``torch.cuda``/``torch.npu`` that fxrt and the tests use. Streams and events are
``torch.Stream``/``torch.Event`` (the backend's guard implements them); memory statistics follow
``torch.cuda``'s names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from . import extension

_C = extension()
name = "fxrt_standin"  # set by standin.load()


def _index(device: Any = None) -> int:
    if device is None:
        return _C.current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        return _C.current_device() if device.index is None else device.index
    raise TypeError(f"not a device: {device!r}")


def is_available() -> bool:
    return True


def device_count() -> int:
    return _C.DEVICE_COUNT


def is_initialized() -> bool:
    return True


def init() -> None:
    pass


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    """In a child forked from a process that used the device (which it cannot use)."""
    return _C.in_bad_fork()


# Random ops run ATen's CPU kernels with the CPU generator, so the device has no RNG state of
# its own: ``torch.manual_seed``/``torch.get_rng_state`` cover it; these keep generic code
# (``torch.random.fork_rng``, ``freeze_rng_state``) working with an empty state.


def manual_seed(seed: int) -> None:
    pass


manual_seed_all = manual_seed


def seed() -> None:
    pass


seed_all = seed


def initial_seed() -> int:
    return torch.initial_seed()


@torch.compiler.disable  # Dynamo would trace it inside freeze_rng_state's no_dispatch block
def get_rng_state(device: Any = None) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


@torch.compiler.disable
def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
    pass


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(states: list[torch.Tensor]) -> None:
    pass


def current_device() -> int:
    return _C.current_device()


def set_device(device: Any) -> None:
    _C.set_device(_index(device))


class device:  # noqa: N801 - torch.cuda.device's name
    """Context manager that makes ``index`` the current device."""

    def __init__(self, index: Any):
        self.idx = _index(index)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = _C.exchange_device(self.idx)

    def __exit__(self, *exc: Any) -> bool:
        _C.set_device(self.prev)
        return False


def synchronize(device: Any = None) -> None:
    """Wait for every stream of the device; raise an asynchronous task's error, if any."""
    _C.synchronize(_index(device))


class Stream(torch.Stream):
    """A stream of this device (``torch.Stream``): from the pool, on the current device unless
    ``device`` says otherwise."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        if kwargs:  # stream_id / device_index / device_type: wrap an existing stream
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=torch.device(name, _index(device)), priority=priority)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def Event(  # noqa: N802 - torch.cuda.Event's name; torch.Event's methods want that exact type
    enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
) -> torch.Event:
    """An event of this device (a ``torch.Event``)."""
    return torch.Event(device=torch.device(name), enable_timing=enable_timing)


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


def current_stream(device: Any = None) -> Stream:
    return _wrap(torch.accelerator.current_stream(_index(device)))


def default_stream(device: Any = None) -> Stream:
    idx = _index(device)
    s = torch.accelerator.current_stream(idx)
    return Stream(stream_id=0, device_index=idx, device_type=s.device_type)


def set_stream(stream: torch.Stream) -> None:
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(s: torch.Stream | None) -> Iterator[None]:
    """Make ``s`` the current stream of its device inside the block (None: no change)."""
    if s is None:
        yield
        return
    prev = torch.accelerator.current_stream(s.device_index)
    torch.accelerator.set_stream(s)
    try:
        yield
    finally:
        torch.accelerator.set_stream(prev)


_use_stream = stream  # for functions with a ``stream`` argument


# --- the delay knob ---------------------------------------------------------------------------


def set_delay_us(us: int, stream: torch.Stream | None = None) -> None:
    """Each task waits ``us`` microseconds before it runs: on every side stream (every stream
    but the devices' default streams, ``FXRT_STANDIN_DELAY_US``), or, with ``stream``, on that
    stream (a default stream too; a negative value goes back to the side-stream setting)."""
    if stream is None:
        _C.set_delay_us(us, -1, 0)
    else:
        _C.set_delay_us(us, stream.device_index, stream.stream_id)


def get_delay_us(stream: torch.Stream | None = None) -> int:
    if stream is None:
        return _C.get_delay_us(-1, 0)
    return _C.get_delay_us(stream.device_index, stream.stream_id)


@contextlib.contextmanager
def delay(us: int, stream: torch.Stream | None = None) -> Iterator[None]:
    """:func:`set_delay_us` inside the block; the streams are synchronized on leaving it."""
    before = (
        _C.get_delay_us(-1, 0)
        if stream is None
        else _C.get_delay_us(stream.device_index, stream.stream_id)
    )
    set_delay_us(us, stream)
    try:
        yield
    finally:
        _C.synchronize_all()
        if stream is None:
            _C.set_delay_us(before, -1, 0)
        else:
            _C.set_delay_us(-1, stream.device_index, stream.stream_id)


def stream_tasks(stream: torch.Stream) -> tuple[int, int]:
    """(tasks enqueued, tasks finished) on ``stream`` since the process started."""
    return _C.stream_tasks(stream.device_index, stream.stream_id)


# --- memory -----------------------------------------------------------------------------------


def memory_stats(device: Any = None) -> dict[str, int]:
    """``torch.cuda.memory_stats``' keys that the stand-in keeps (``allocation.all.current``,
    ``allocated_bytes.all.peak``, ``num_device_alloc``...)."""
    raw = _C.memory_stats(_index(device))
    out: dict[str, int] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            for k, v in value.items():
                out[f"{key}.all.{k}"] = v
        else:
            out[key] = value
    return out


def allocation_count(device: Any = None) -> int:
    """Allocations made on the device since the process started (or the last
    :func:`reset_accumulated_memory_stats`): what "no allocation per steady call" counts."""
    return _C.memory_stats(_index(device))["allocation"]["allocated"]


def memory_allocated(device: Any = None) -> int:
    return _C.memory_stats(_index(device))["allocated_bytes"]["current"]


def max_memory_allocated(device: Any = None) -> int:
    return _C.memory_stats(_index(device))["allocated_bytes"]["peak"]


def memory_reserved(device: Any = None) -> int:
    return _C.memory_stats(_index(device))["reserved_bytes"]["current"]


def max_memory_reserved(device: Any = None) -> int:
    return _C.memory_stats(_index(device))["reserved_bytes"]["peak"]


def reset_peak_memory_stats(device: Any = None) -> None:
    _C.reset_peak(_index(device))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    _C.reset_accumulated(_index(device))


def empty_cache() -> None:
    """Synchronize, then return every cached block to the host."""
    for d in range(device_count()):
        _C.empty_cache(d)


def set_poison(on: bool) -> None:
    """Fill new host memory with 0xFF bytes (NaN for floats; the default, or
    ``FXRT_STANDIN_POISON=0``), so reads of memory nothing wrote show up."""
    _C.set_poison(on)


def pending_frees(device: Any = None) -> int:
    """Freed blocks waiting for the streams ``record_stream`` named to pass."""
    return _C.pending_frees(_index(device))


# --- graphs -----------------------------------------------------------------------------------


class Graph:
    """A captured sequence of device work, as ``torch.cuda.CUDAGraph``: between
    :meth:`capture_begin` and :meth:`capture_end` the current (side) stream records its tasks
    instead of running them and allocations on it come from the graph's private pool (shared
    with other graphs through ``pool``); :meth:`replay` submits them all, in order, as one task
    (one host launch) on the current stream, reading and writing the memory the capture used.
    While capturing, the host may not synchronize with, copy through, or wait for the capturing
    stream (that invalidates the capture: :meth:`capture_end` raises). Another stream that waits
    for an event recorded in the capture joins it (fork/join, as on CUDA) and must be joined
    back (a stream of the capture waits for its last task) before :meth:`capture_end`; a replay
    then launches once on each stream that took part."""

    def __init__(self) -> None:
        self._handle = _C.graph_create()

    def capture_begin(self, pool: int | None = None) -> None:
        _C.capture_begin(self._handle, 0 if pool is None else pool)

    def capture_end(self) -> None:
        _C.capture_end(self._handle)

    def replay(self) -> None:
        _C.graph_replay(self._handle)

    def reset(self) -> None:
        """Forget the capture; its private pool's memory goes back once no graph uses it."""
        _C.graph_reset(self._handle)

    def pool(self) -> int:
        return _C.graph_pool(self._handle)

    def num_tasks(self) -> int:
        """How many tasks the capture recorded (what one replay runs)."""
        return _C.graph_tasks(self._handle)

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None and _C is not None:
            _C.graph_destroy(handle)


def graph_pool_handle() -> int:
    """A new private pool id, to share one pool between graphs (``capture_begin(pool=...)``)."""
    return _C.graph_pool_handle()


@contextlib.contextmanager
def graph(g: Graph, pool: int | None = None, stream: torch.Stream | None = None) -> Iterator[None]:
    """Capture the block into ``g`` on ``stream`` (a new side stream by default), which first
    waits for the current stream, as ``torch.cuda.graph`` does."""
    s = stream if stream is not None else Stream()
    s.wait_stream(current_stream(s.device_index))
    with _use_stream(s):
        g.capture_begin(pool)
        try:
            yield
        finally:
            g.capture_end()


def is_current_stream_capturing(device: Any = None) -> bool:
    s = torch.accelerator.current_stream(_index(device))
    return _C.is_capturing(s.device_index, s.stream_id)


def launches(stream: torch.Stream) -> int:
    """Host launches onto ``stream`` so far: each op, copy, event or replay enqueued is one;
    work a capture records is none."""
    return _C.stream_tasks(stream.device_index, stream.stream_id)[0]
