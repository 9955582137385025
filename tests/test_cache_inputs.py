"""The cache key of a graph's non-tensor inputs: opaque objects (``torch.library``'s registered
types, which Dynamo lifts to graph inputs when hoisted; a serving engine's layer names) are keyed
by the value their type declares, never by an address, so a second process hits; an input with no
value to key by leaves the graph uncached, with a log line."""

from __future__ import annotations

import enum

import pytest
import torch
from conftest import EXECUTORS, run_child, skip_unless_executor

import fxrt
from fxrt import cache

MODEL = """
    import json, sys, torch, fxrt
    from torch._opaque_base import OpaqueBase
    from torch._library.opaque_object import register_opaque_type

    class LayerName(OpaqueBase):
        def __init__(self, value):
            self.value = value
        def __eq__(self, other):
            return isinstance(other, LayerName) and self.value == other.value
        def __hash__(self):
            return hash(self.value)
        def __fx_repr__(self):
            return f"LayerName({self.value!r})", {"LayerName": LayerName}

    register_opaque_type(LayerName, typ="value", hoist=True)
    SCALES = {"a": 2.0, "b": -3.0, "c": 0.5}

    @torch.library.custom_op("fxrt_test_opaque::scale", mutates_args=())
    def scale(x: torch.Tensor, name: LayerName) -> torch.Tensor:
        return x * SCALES[name.value]

    @scale.register_fake
    def _(x, name):
        return torch.empty_like(x)

    class Model(torch.nn.Module):
        def __init__(self, first):
            super().__init__()
            self.first, self.second = LayerName(first), LayerName("b")
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            scale = torch.ops.fxrt_test_opaque.scale
            return scale(self.lin(x), self.first) + scale(x, self.second)

    torch.manual_seed(0)
    model = Model(sys.argv[1]).eval()
    compiled = torch.compile(model, backend="fxrt", fullgraph=True)
    with torch.no_grad():
        for seed in (1, 2):
            torch.manual_seed(seed)
            x = torch.randn(3, 4)
            torch.testing.assert_close(compiled(x), model(x))
    print(json.dumps(dict(fxrt.cache.stats)))
"""


@pytest.mark.parametrize("executor", EXECUTORS)
def test_opaque_value_inputs_hit_in_a_second_process(tmp_path, executor):
    skip_unless_executor(executor)
    cold = run_child(MODEL, tmp_path, executor, "a")
    assert cold.get("stored") == 1 and cold.get("hit", 0) == 0, cold
    warm = run_child(MODEL, tmp_path, executor, "a")
    assert warm.get("hit") == 1 and warm.get("compiled", 0) == 0, warm
    # Another layer name is another value: its own entry, its own answers.
    other = run_child(MODEL, tmp_path, executor, "c")
    assert other.get("miss") == 1 and other.get("stored") == 1, other


def _key(*extra):
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxrt.cache.keys import cache_key
    from fxrt.ir import from_fx

    x = torch.randn(3)
    gm = make_fx(lambda x: x.cos())(x)
    return cache_key(from_fx(gm, [x]), [x, *extra], fxrt.CompilerConfig())


def test_opaque_value_inputs_are_keyed_by_value():

    class Colour(enum.Enum):  # enums are opaque value types
        RED = 1
        BLUE = 2

    assert _key(Colour.RED) == _key(Colour.RED) != _key(Colour.BLUE)
    assert _key(2, "a", None, torch.float16) == _key(2, "a", None, torch.float16)
    assert _key(2) != _key(3) and _key("a") != _key("b")


def test_an_input_without_a_value_is_unkeyable():
    class Handle:  # no registered type: its repr would hold an address
        pass

    with pytest.raises(cache.Unkeyable, match="Handle"):
        _key(Handle())
