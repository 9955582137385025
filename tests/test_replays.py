"""The per-call side of whole-graph capture (fxrt.exec.replays and its C++ twin, replays.h): the
same calls through both give the same signatures, the same answers on moved inputs and the same
outputs. The "graph" here is a Python function that writes the pool buffer, so what a replay
returns can be checked exactly; tests/test_capture.py runs the same code under real captures.
"""

from __future__ import annotations

import pytest
import standin
import torch
from conftest import skip_unless_executor
from test_standin_fxrt import _idle_device  # noqa: F401 - the fixture

from fxrt.exec.native import NativeReplayIndex
from fxrt.exec.replays import ReplayIndex


@pytest.fixture
def index(dev, executor):
    skip_unless_executor(executor)
    device = torch.device(standin.name(), 0)
    return (NativeReplayIndex if executor == "cpp" else ReplayIndex)(device)


def on_dev(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype).to(standin.name())


def test_signatures_tell_apart_what_capture_depends_on(index):
    x = on_dev(2, 3)
    calls = {
        "x": [x, 1],
        "same layout, other tensor": [on_dev(2, 3), 1],
        "dtype": [on_dev(2, 3, dtype=torch.float64), 1],
        "size": [on_dev(3, 3), 1],
        "strides": [on_dev(3, 2).t(), 1],
        "storage offset": [on_dev(7)[1:].view(2, 3), 1],
        "int value": [x, 2],
        "bool, not int": [x, True],
        "float": [x, 1.0],
        "-0.0 is 0.0": [x, -0.0],
        "0.0": [x, 0.0],
        "None": [x, None],
        "an object": [x, "a"],
        "an equal object": [x, "".join(["a"])],
        "a big int": [x, 2**80],
    }
    ids = {}
    for name, inputs in calls.items():
        found = index.find(inputs)
        ids[name] = found if found >= 0 else index.add(inputs)
    assert ids["same layout, other tensor"] == ids["x"]
    assert ids["-0.0 is 0.0"] == ids["0.0"]
    assert ids["an equal object"] == ids["an object"]
    others = [v for k, v in ids.items() if k not in ("same layout, other tensor", "-0.0 is 0.0")]
    others.remove(ids["an equal object"])
    assert len(set(others)) == len(others), ids
    assert sorted(set(ids.values())) == list(range(len(set(ids.values()))))  # ids in order
    with torch.no_grad():
        assert index.find([x, 1]) == -1  # grad mode is part of it
    with torch.inference_mode():
        assert index.find([x, 1]) == -1
    with pytest.raises(ValueError, match="already has an id"):
        index.add([x, 1])
    with pytest.raises(TypeError):  # a value that cannot be hashed, as a dict key would say
        index.find([x, [1]])


def armed(index, x, clone=True, build=tuple):
    """A signature for ``[x, w]`` whose "graph" writes x * 2 into a pool buffer and returns
    (that, a view of input 0, a constant); w is fixed, x copied into a static buffer."""
    w = on_dev(4)
    static = torch.empty_like(x)
    pool = torch.empty(x.numel() * 4, dtype=torch.uint8, device=x.device)
    out = torch.empty(0, dtype=x.dtype, device=x.device)
    out.set_(pool.untyped_storage(), 0, x.shape, (2, 1))
    calls = []

    def replay():
        calls.append(1)
        out.copy_(static * 2)

    const = torch.ones(1)
    leaves = [("pool", 0, out), ("input", 0, x[1:]), ("value", const)]
    if not clone:
        leaves[0] = ("value", out)
    id = index.add([x, w])
    index.arm(id, [(1, w.data_ptr())], [(0, static, False)], replay, leaves, [pool], clone, build)
    return id, w, out, const, calls


def test_replay_copies_in_and_makes_the_outputs(index):
    x = on_dev(3, 2)
    id, w, out, const, calls = armed(index, x)
    for _ in range(3):
        x = on_dev(3, 2)
        got = index.call([x, w])
        assert index.replayed and index.last_id == id and index.moved == -1
        doubled, view, c = got
        torch.testing.assert_close(doubled.cpu(), x.cpu() * 2)
        assert doubled.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()  # a clone
        assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert view.shape == (2, 2) and view.storage_offset() == 2
        torch.testing.assert_close(view.cpu(), x[1:].cpu())
        assert c is const
    assert len(calls) == 3 and index.replays(id) == 3


def test_without_clones_the_pool_tensor_is_returned(index):
    x = on_dev(3, 2)
    id, w, out, _, _ = armed(index, x, clone=False, build=list)
    got = index.call([on_dev(3, 2), w])
    assert type(got) is list and got[0] is out


def test_a_moved_fixed_input_replays_nothing(index):
    x = on_dev(3, 2)
    id, w, _, _, calls = armed(index, x)
    assert index.call([x, on_dev(4)]) is None
    assert not index.replayed and index.last_id == id
    assert index.moved == 1 and index.why == "changed address" and not calls
    assert index.call([on_dev(5), w]) is None  # another signature: none known
    assert index.last_id == -1 and index.moved == -1 and index.why == ""
    index.disarm(id)
    assert index.call([x, w]) is None and index.last_id == id and index.moved == -1


def test_a_whole_storage_copy_checks_the_storage_size(index):
    base = on_dev(8)
    x = base[:6].view(3, 2)
    static = on_dev(8)[:6].view(3, 2)
    seen = []
    id = index.add([x])
    leaves = [("value", None)]
    replay = lambda: seen.append(static.cpu())  # noqa: E731
    index.arm(id, [], [(0, static, True)], replay, leaves, [], True, list)
    assert index.call([x]) == [None]
    torch.testing.assert_close(seen[-1], x.cpu())
    other = on_dev(9)[:6].view(3, 2)  # same signature, a bigger storage
    assert index.call([other]) is None
    assert index.moved == 0 and index.why == "changed storage size"


def test_bad_ids_and_clear(index):
    with pytest.raises(IndexError, match="no input signature has id 0"):
        index.replays(0)
    x = on_dev(2)
    id = index.add([x])
    index.clear()
    assert index.find([x]) == -1
    with pytest.raises(IndexError):
        index.disarm(id)


def test_an_error_in_the_replay_propagates(index):
    x = on_dev(2)
    id = index.add([x])

    def replay():
        raise RuntimeError("device lost")

    index.arm(id, [], [], replay, [("value", 1)], [], True, tuple)
    with pytest.raises(RuntimeError, match="device lost"):
        index.call([x])
