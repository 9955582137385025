"""The stand-in accelerator itself (tests/standin): ops against CPU, views without a stream,
streams that run asynchronously, events that order them, the delay knob that makes a missing
wait reproducible, the caching allocator's counters and its record_stream rule, copies that
synchronize, errors raised at the next synchronization, torch.Stream/Event/accelerator, two
devices, and the backend renamed to ``npu`` in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.fixture
def name(dev) -> str:
    return dev.name


@pytest.fixture(autouse=True)
def _quiet_streams(request):
    """Each test starts and ends with idle streams, no delay and no pending error."""
    if "dev" not in request.fixturenames:
        yield
        return
    d = request.getfixturevalue("dev")
    d.set_delay_us(0)
    yield
    for i in range(d.device_count()):
        d.synchronize(i)
    d.set_delay_us(0)
    for i in range(d.device_count()):
        d.set_delay_us(-1, d.default_stream(i))


def unique_numel(tag: int) -> int:
    """A float32 element count whose 512-byte-rounded block size no other test allocates, so
    that which block the allocator hands out next is certain."""
    return 128 * (1000 + tag) + 1


# --- ops ---------------------------------------------------------------------------------------


def test_ops_match_cpu(dev, name):
    torch.manual_seed(0)
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    da, db = a.to(name), b.to(name)
    assert da.device == torch.device(name, 0)
    checks = [
        ((da * 2 + 1).sin(), (a * 2 + 1).sin()),
        (da @ db, a @ b),
        (da.sum(1), a.sum(1)),
        (da.softmax(-1), a.softmax(-1)),
        (torch.cat([da, da], 0), torch.cat([a, a], 0)),
        (da.max(1).values, a.max(1).values),
        (da.max(1).indices, a.max(1).indices),
        (da[da > 0], a[a > 0]),  # data-dependent shape: the host runs it
        (da.nonzero(), a.nonzero()),
        (da.double().t().contiguous(), a.double().t().contiguous()),
        (torch.arange(6, device=name), torch.arange(6)),
        (torch.zeros(2, 3, device=name), torch.zeros(2, 3)),
        (
            da.index_select(0, torch.tensor([4, 0], device=name)),
            a.index_select(0, torch.tensor([4, 0])),
        ),
        (da.topk(2).values, a.topk(2).values),
    ]
    for got, want in checks:
        assert got.device.type == name
        torch.testing.assert_close(got.cpu(), want)
    assert da.sum().item() == pytest.approx(a.sum().item(), rel=1e-5)
    assert torch.equal(da, da.clone()) and not torch.equal(da, da + 1)


def test_inplace_and_out_variants(dev, name):
    a = torch.randn(4, 4)
    da = a.to(name)
    da.mul_(3).add_(1)
    torch.testing.assert_close(da.cpu(), a * 3 + 1)
    out = torch.empty(0, device=name)
    torch.add(da, 1, out=out)  # out= resizes the empty tensor first
    assert out.shape == (4, 4)
    torch.testing.assert_close(out.cpu(), a * 3 + 2)
    v = da[1:3]
    v.zero_()  # writes through a view reach the base
    assert torch.equal(da[1:3].cpu(), torch.zeros(2, 4))


def test_views_alias_and_never_reach_a_stream(dev, name):
    x = torch.randn(4, 6, device=name)
    dev.synchronize()
    before = dev.stream_tasks(dev.current_stream())[0]
    views = [x.t(), x.view(24), x[1:, ::2], x.permute(1, 0), x.unsqueeze(0).expand(3, 4, 6)]
    views += [
        x.reshape(2, 12),
        x.select(0, 2),
        x.unflatten(1, (2, 3)),
        x.detach(),
        x.narrow(1, 1, 2),
    ]
    views += list(x.split(2, 1)) + list(x.unbind(0)) + [x.as_strided((2, 2), (1, 6), 3)]
    assert dev.stream_tasks(dev.current_stream())[0] == before  # metadata only
    for v in views:
        assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    host = x.cpu()
    torch.testing.assert_close(views[2].cpu(), host[1:, ::2])
    torch.testing.assert_close(views[-1].cpu(), host.view(-1).as_strided((2, 2), (1, 6), 3))
    assert x.t()._base is x


def test_two_devices(dev, name):
    a = torch.randn(8)
    d0 = a.to(name)
    d1 = d0.to(f"{name}:1")
    assert d1.device == torch.device(name, 1)
    with dev.device(1):
        assert dev.current_device() == 1
        y = torch.ones(8, device=name) + d1
    assert dev.current_device() == 0 and y.device.index == 1
    torch.testing.assert_close(y.cpu(), a + 1)
    with pytest.raises(RuntimeError, match="same device"):
        d0 + d1
    with pytest.raises(RuntimeError, match="same device"):
        d0 + torch.ones(8)  # a CPU tensor of rank > 0, as on CUDA
    torch.testing.assert_close((d0 + torch.tensor(2.0)).cpu(), a + 2)  # a CPU scalar is fine


# --- streams and events -------------------------------------------------------------------------


def test_streams_run_asynchronously(dev, name):
    side = dev.Stream()
    x = torch.ones(64, device=name)
    side.wait_stream(dev.current_stream())  # x was made on the default stream
    with dev.delay(100_000, side), dev.stream(side):
        t0 = time.perf_counter()
        y = x
        for _ in range(5):
            y = y + 1
        host = time.perf_counter() - t0
        enqueued, done = dev.stream_tasks(side)
        assert enqueued - done >= 3 and not side.query()
        assert host < 0.3, "the host waited for the stream"
        side.synchronize()
        assert side.query()
    assert torch.equal(y.cpu(), torch.full((64,), 6.0))


def test_events_order_streams(dev, name):
    main, side = dev.current_stream(), dev.Stream()
    for wait in (True, False):
        x = torch.zeros(1000, device=name)
        dev.synchronize()
        with dev.delay(200_000, main):  # the default stream lags now
            x.add_(1)  # on main, 200 ms from now
            ev = dev.Event()
            ev.record(main)
            if wait:
                side.wait_event(ev)
            with dev.stream(side):
                y = x * 2
                got = y.cpu()  # waits for the side stream only
        if wait:
            assert torch.equal(got, torch.full((1000,), 2.0))
            assert ev.query()
        else:  # the side stream read x before main added 1
            assert torch.equal(got, torch.zeros(1000))


def test_event_timing_and_queries(dev, name):
    s = dev.Stream()
    start, end = dev.Event(enable_timing=True), dev.Event(enable_timing=True)
    with dev.delay(50_000, s), dev.stream(s):
        start.record()
        torch.ones(16, device=name).add_(1)
        end.record()
        assert not end.query()
        end.synchronize()
        assert end.query()
    assert start.elapsed_time(end) >= 100.0  # ms: three delayed tasks after start
    untimed = dev.Event()
    untimed.record()
    untimed.synchronize()
    with pytest.raises((RuntimeError, ValueError), match="enable_timing"):
        untimed.elapsed_time(end)


def test_torch_stream_event_accelerator_apis(dev, name):
    assert torch.accelerator.current_accelerator().type == name
    assert torch.accelerator.device_count() == 2
    s = torch.Stream(device=name)
    assert s.device.type == name and s.stream_id != 0
    with s:  # torch.Stream as a context manager sets the current stream
        assert torch.accelerator.current_stream().stream_id == s.stream_id
        e = torch.Event(device=name)
        e.record()
    assert torch.accelerator.current_stream().stream_id == 0
    e.synchronize()
    torch.accelerator.synchronize()
    x = torch.empty(1000, device=name)
    assert torch.accelerator.memory_allocated() >= 4000
    del x
    assert dev.current_stream().stream_id == 0 and dev.default_stream().stream_id == 0


def test_delay_knob(dev, name):
    """With side streams delayed, a result used on the default stream without a wait is read
    before it is written: a wrong answer, every time. With the wait it is right."""
    main, side = dev.current_stream(), dev.Stream()
    x = torch.randn(4096, device=name)
    want = x.cpu() * 2 + 1
    with dev.delay(200_000):
        assert dev.get_delay_us() == 200_000 and dev.get_delay_us(side) == 200_000
        assert dev.get_delay_us(main) == 0
        side.wait_stream(main)
        with dev.stream(side):
            y = x * 2
        wrong = (y + 1).cpu()  # main: no wait for side
        main.wait_stream(side)
        right = (y + 1).cpu()
    assert not torch.allclose(wrong, want, equal_nan=False)
    torch.testing.assert_close(right, want)
    assert dev.get_delay_us() == 0


def test_delay_from_the_environment():
    code = (
        "import standin, torch\n"
        "dev = standin.load()\n"
        "side, main = dev.Stream(), dev.current_stream()\n"
        "print(dev.get_delay_us(), dev.get_delay_us(side), dev.get_delay_us(main))\n"
    )
    env = {**os.environ, "FXRT_STANDIN_DELAY_US": "1234", "PYTHONPATH": str(HERE)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    if "no C++ compiler" in proc.stderr:
        pytest.skip("no C++ compiler to build the stand-in device")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1234", "1234", "0"]


# --- allocator ----------------------------------------------------------------------------------


def test_allocator_counts_and_frees(dev, name):
    dev.synchronize()
    base_count, base_bytes = dev.allocation_count(), dev.memory_allocated()
    x = torch.empty(1000, device=name)  # one block of 4096 bytes (rounded to 512)
    y = x + 1
    assert dev.allocation_count() - base_count == 2
    assert dev.memory_allocated() - base_bytes == 2 * 4096
    stats = dev.memory_stats()
    assert stats["allocation.all.current"] >= 2 and stats["allocated_bytes.all.peak"] >= 8192
    del x, y
    assert dev.memory_allocated() == base_bytes
    z = torch.empty(1000, device=name)  # from the cache: no new host memory
    reserved = dev.memory_reserved()
    del z
    assert dev.memory_reserved() == reserved
    dev.empty_cache()
    assert dev.memory_reserved() <= reserved and dev.memory_allocated() == base_bytes


def test_fresh_memory_is_poisoned(dev, name):
    dev.empty_cache()
    x = torch.empty(unique_numel(1), device=name)
    assert torch.isnan(x.cpu()).all()


@pytest.mark.parametrize("recorded", [True, False])
def test_record_stream_keeps_a_block_until_the_stream_passes(dev, name, recorded):
    """A block freed while another stream still reads it is not reused until that stream has
    passed what it was given, when record_stream named it. Without record_stream, the next
    allocation of its size on the same stream gets it and overwrites what the side stream has
    yet to read (the hazard record_stream exists for)."""
    n = unique_numel(2 if recorded else 3)
    main, side = dev.current_stream(), dev.Stream()
    x = torch.randn(n, device=name)
    want = x.cpu() * 2
    with dev.delay(200_000, side):
        side.wait_stream(main)
        with dev.stream(side):
            y = x * 2  # runs in 200 ms
        if recorded:
            x.record_stream(side)
        ptr = x.data_ptr()
        del x
        assert dev.pending_frees() == (1 if recorded else 0)
        w = torch.empty(n, device=name)
        assert (w.data_ptr() == ptr) is not recorded
        w.fill_(0.0)  # main stream: runs at once
        side.synchronize()
        got = y.cpu()
    if recorded:
        torch.testing.assert_close(got, want)
        assert dev.pending_frees() == 0
    else:
        assert torch.equal(got, torch.zeros(n))


def test_record_stream_on_a_storage_slice_is_ignored(dev, name):
    """A tensor on a slice of another storage (``UntypedStorage[a:b]``, as fxrt's arena slots
    are) has a DataPtr the allocator did not make: record_stream on it does nothing, as on
    CUDA's caching allocator. Only the allocation itself can be recorded."""
    side = dev.Stream()
    buffer = torch.empty(4096, dtype=torch.uint8, device=name).untyped_storage()
    slot = torch.empty(0, device=name).set_(buffer[512:1024], 0, (128,), (1,))
    slot.record_stream(side)
    del buffer
    assert dev.pending_frees() == 0
    del slot  # the block is freed now, with no stream recorded
    assert dev.pending_frees() == 0
    buffer = torch.empty(4096, dtype=torch.uint8, device=name)
    with dev.delay(200_000, side):
        buffer.record_stream(side)
        with dev.stream(side):
            torch.ones(1, device=name)  # side has pending work now
        del buffer
        assert dev.pending_frees() == 1


# --- copies and errors --------------------------------------------------------------------------


def test_copies_to_the_host_wait_for_the_stream(dev, name):
    main = dev.current_stream()
    x = torch.zeros(256, device=name)
    with dev.delay(20_000, main):
        x.add_(5)
        t0 = time.perf_counter()
        got = x.cpu()  # waits for add_ (20 ms) and the copy itself
        assert time.perf_counter() - t0 >= 0.015
        assert torch.equal(got, torch.full((256,), 5.0))
        src = torch.full((256,), 7.0)
        x.copy_(src)  # host to device: waits too, so the host may reuse src at once
        assert main.query()
        src.fill_(0)
    assert torch.equal(x.cpu(), torch.full((256,), 7.0))


def test_async_errors_surface_at_the_next_synchronization(dev, name):
    x = torch.randn(4, device=name)
    bad = torch.tensor([0, 9], device=name)
    y = x.index_select(0, bad)  # enqueued; the CPU kernel fails in the worker
    with pytest.raises(RuntimeError, match="asynchronous task failed.*index"):
        dev.synchronize()
    dev.synchronize()  # reported once
    del y


def test_resize_and_set(dev, name):
    x = torch.arange(6.0, device=name)
    x.resize_(12)
    assert x.shape == (12,)
    torch.testing.assert_close(x[:6].cpu(), torch.arange(6.0))
    s = torch.arange(4.0, device=name).untyped_storage()
    t = torch.empty(0, device=name).set_(s, 1, (2,), (1,))
    torch.testing.assert_close(t.cpu(), torch.tensor([1.0, 2.0]))


# --- graphs -------------------------------------------------------------------------------------


def test_graph_records_then_replays_in_one_launch(dev, name):
    main = dev.current_stream()
    x = torch.randn(unique_numel(4), device=name)  # a static input
    g = dev.Graph()
    side = dev.Stream()
    with dev.graph(g, stream=side):
        assert dev.is_current_stream_capturing()
        launches = dev.launches(side)
        y = (x * 2).sin() + 1  # recorded, not run
        assert dev.launches(side) == launches  # nothing reached the queue
    assert not dev.is_current_stream_capturing()
    assert g.num_tasks() == 3
    assert torch.isnan(y.cpu()).all()  # fresh pool memory that nothing wrote yet
    for _ in range(2):
        x.copy_(torch.randn(x.shape))
        launches = dev.launches(main)
        g.replay()
        assert dev.launches(main) == launches + 1
        torch.testing.assert_close(y.cpu(), (x.cpu() * 2).sin() + 1)


def test_graph_replay_is_asynchronous_and_allocates_nothing(dev, name):
    x = torch.randn(256, device=name)
    g = dev.Graph()
    dev.synchronize()
    count = dev.allocation_count()
    with dev.graph(g):
        y = torch.relu(x @ x.new_ones(256, 8)) * 3
    assert dev.allocation_count() > count  # from the graph's private pool
    reserved = dev.memory_reserved()
    count = dev.allocation_count()
    main = dev.current_stream()
    with dev.delay(200_000, main):
        g.replay()
        assert not main.query()  # the host did not wait
        g.replay()
        got = y.cpu()
    assert dev.allocation_count() == count and dev.memory_reserved() == reserved
    torch.testing.assert_close(got, torch.relu(x.cpu() @ torch.ones(256, 8)) * 3)
    # A second graph on the first one's pool; both keep their memory until reset.
    g2 = dev.Graph()
    with dev.graph(g2, pool=g.pool()):
        z = y + 1
    assert g2.pool() == g.pool()
    g2.replay()
    torch.testing.assert_close(z.cpu(), got + 1)
    del y, z
    g.reset()
    g2.reset()
    assert dev.memory_reserved() < reserved


@pytest.mark.parametrize(
    "forbidden",
    ["copy to host", "item", "synchronize", "copy from host", "data-dependent shape"],
)
def test_host_synchronization_invalidates_a_capture(dev, name, forbidden):
    x = torch.randn(8, device=name)
    g = dev.Graph()
    side = dev.Stream()
    side.wait_stream(dev.current_stream())
    with dev.stream(side):
        g.capture_begin()
        with pytest.raises(RuntimeError, match="not permitted while .* capturing"):
            if forbidden == "copy to host":
                x.cpu()
            elif forbidden == "item":
                x.sum().item()
            elif forbidden == "synchronize":
                dev.synchronize()
            elif forbidden == "copy from host":
                x.copy_(torch.zeros(8))
            else:
                x[x > 0]
        with pytest.raises(RuntimeError, match="invalidated"):
            g.capture_end()
    with pytest.raises(RuntimeError, match="not captured"):
        g.replay()


def test_multi_stream_capture_forks_and_joins(dev, name):
    """A side stream that waits for an event of the capture joins it; the replay runs each
    branch on its own stream (one launch each), ordered by the captured waits, and gives the
    right answer although side streams lag (the delay knob)."""
    x = torch.randn(64, device=name)
    g = dev.Graph()
    origin, branch = dev.Stream(), dev.Stream()
    with dev.graph(g, stream=origin):
        a = x * 2  # on the origin
        fork = torch.Event(device=name)
        fork.record(origin)
        branch.wait_event(fork)  # the branch joins the capture
        with dev.stream(branch):
            b = (a + 1).sin()  # reads what the origin wrote before the fork
        join = torch.Event(device=name)
        join.record(branch)
        origin.wait_event(join)
        c = a * b
    assert g.num_tasks() >= 5
    main = dev.current_stream()
    with dev.delay(3000):
        for _ in range(3):
            x.copy_(torch.randn(64))
            before = dev.launches(main), dev.launches(branch)
            g.replay()
            assert (dev.launches(main), dev.launches(branch)) == (before[0] + 1, before[1] + 1)
            want = x.cpu() * 2 * (x.cpu() * 2 + 1).sin()
            torch.testing.assert_close(c.cpu(), want)


def test_multi_stream_capture_must_join_back(dev, name):
    x = torch.randn(8, device=name)
    g = dev.Graph()
    origin, branch = dev.Stream(), dev.Stream()
    with pytest.raises(RuntimeError, match="unjoined work"):
        with dev.graph(g, stream=origin):
            fork = torch.Event(device=name)
            fork.record(origin)
            branch.wait_event(fork)
            with dev.stream(branch):
                x.add_(1)  # nobody waits for this before the capture ends


def test_capture_needs_a_side_stream(dev, name):
    g = dev.Graph()
    with pytest.raises(RuntimeError, match="default stream"):
        g.capture_begin()


# --- the npu name -------------------------------------------------------------------------------


def test_renamed_to_npu_in_a_child_process():
    """Without torch_npu, a process may call the stand-in ``npu``: ``torch.npu`` and
    ``Tensor.npu()`` then exist, and fxrt compiles and runs a graph on ``npu:0`` (its input
    checks name the device ``npu:0``)."""
    code = r"""
import importlib.util, torch
if importlib.util.find_spec("torch_npu") is not None:
    print("SKIP torch_npu is installed"); raise SystemExit(0)
import standin, fxrt
from torch.fx.experimental.proxy_tensor import make_fx
dev = standin.load("npu")
assert torch.npu is dev and torch.npu.device_count() == 2
x = torch.randn(3, 4).npu()
assert str(x.device) == "npu:0" and x.is_npu
f = lambda x: (x.sin() * 2).sum(0)
for pure in (True, False):
    cg = fxrt.compile_graph(make_fx(f)(x), [x], fxrt.CompilerConfig(pure_python=pure, cache=False))
    torch.testing.assert_close(cg(x).cpu(), f(x.cpu()))
    try:
        cg(x.cpu())
    except fxrt.InputError as e:
        assert "@npu:0" in str(e), str(e)
    else:
        raise AssertionError("no InputError")
torch.npu.synchronize()
print("OK")
"""
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    if "no C++ compiler" in proc.stderr:
        pytest.skip("no C++ compiler to build the stand-in device")
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip()[5:])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
