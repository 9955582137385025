"""The fused patterns' NPU targets, selected on the stand-in device: stand-in kernels registered
under torch_npu's op names (``npu::npu_rms_norm``, ...), the stand-in's device type mapped to the
NPU targets (``fxrt.patterns.use_targets_of``), and the same blocks as tests/test_patterns.py
compiled on the device: the graph calls the vendor's ops, chosen at compile time, and equals
eager on the CPU, on both loops. Without the mapping the device has no targets and keeps the ATen
ops. torch_npu itself is never imported.
"""

from __future__ import annotations

import pytest
import standin
import torch
import torch.nn.functional as F
from conftest import recording_compiles, skip_unless_executor
from test_patterns import Residual, RMSNorm, Rope, _cos_sin, rotate_half
from torch import nn

import fxrt
from fxrt.patterns import use_targets_of

_lib: torch.library.Library | None = None


def _define_npu_ops() -> None:
    """torch_npu's fused ops' schemas, with stand-in kernels that compute them with ATen."""
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("npu", "FRAGMENT")
    _lib.define("npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)")
    _lib.define(
        "npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) "
        "-> (Tensor, Tensor, Tensor)"
    )
    _lib.define(
        "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor"
    )
    _lib.define("npu_swiglu(Tensor self, int dim=-1) -> Tensor")

    def rms(x, gamma, eps=1e-6):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return gamma * (x * rstd), rstd

    def add_rms(x1, x2, gamma, eps=1e-6):
        x = x1 + x2
        y, rstd = rms(x, gamma, eps)
        return y, rstd, x

    def rotary(x, cos, sin, mode="half"):
        assert mode == "half"
        return x * cos + rotate_half(x) * sin

    def swiglu(x, dim=-1):
        a, b = x.chunk(2, dim)
        return F.silu(a) * b

    for name, fn in [("npu_rms_norm", rms), ("npu_add_rms_norm", add_rms),
                     ("npu_rotary_mul", rotary), ("npu_swiglu", swiglu)]:  # fmt: skip
        _lib.impl(name, fn, "PrivateUse1")


class FusedGateUp(nn.Module):
    """Phi-3's MLP: one projection, chunked into gate and up."""

    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(32, 128), nn.Linear(64, 32)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


def _x(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


CASES = {
    "rms_norm": (lambda: RMSNorm(), lambda s: (_x(s, 2, 7, 32),), {"rms_norm": 1}),
    "add_rms_norm": (
        lambda: Residual(),
        lambda s: (_x(s, 2, 5, 32), _x(s + 7, 2, 5, 32)),
        {"add_rms_norm": 2},
    ),
    "rotary": (lambda: Rope(), lambda s: (_x(s, 2, 6, 32), *_cos_sin(6, 8, s)), {"rotary": 2}),
    "gated_mlp": (lambda: FusedGateUp(), lambda s: (_x(s, 3, 32),), {"gated_mlp": 1}),
}
NPU_OPS = {"rms_norm": "npu::npu_rms_norm", "add_rms_norm": "npu::npu_add_rms_norm",
           "rotary": "npu::npu_rotary_mul", "gated_mlp": "npu::npu_swiglu"}  # fmt: skip


def _run(dev, case: str, executor: str) -> list[fxrt.CompiledGraph]:
    skip_unless_executor(executor)
    make, inputs, _ = CASES[case]
    torch.manual_seed(0)
    model = make()
    on_device = make()
    on_device.load_state_dict(model.state_dict())
    on_device.to(standin.name())
    torch._dynamo.reset()
    compiled = torch.compile(
        on_device, backend="fxrt", options={"pure_python": executor == "python", "cache": False}
    )
    with recording_compiles() as built, torch.no_grad():
        for seed in (0, 1):
            args = inputs(seed)
            got = compiled(*(a.to(standin.name()) for a in args))
            expected = model(*args)
            got = got if isinstance(got, tuple) else (got,)
            expected = expected if isinstance(expected, tuple) else (expected,)
            for g, e in zip(got, expected):
                torch.testing.assert_close(g.cpu(), e, rtol=1e-5, atol=1e-5)
    return built


@pytest.mark.parametrize("case", list(CASES))
def test_npu_targets_selected_on_the_device(dev, case, executor):
    _define_npu_ops()
    use_targets_of(standin.name(), "npu")
    try:
        built = _run(dev, case, executor)
    finally:
        use_targets_of(standin.name(), None)
    counts = {}
    for cg in built:
        for k, v in fxrt.pattern_counts(cg).items():
            counts[k] = counts.get(k, 0) + v
    assert counts == CASES[case][2]
    ops = {n.op.name for cg in built for n in cg.graph.nodes}
    assert NPU_OPS[case] in ops
    assert not any(name.startswith("fxrt::") for name in ops)


@pytest.mark.parametrize("case", ["rms_norm", "rotary"])
def test_a_device_without_targets_keeps_the_aten_ops(dev, case, executor):
    built = _run(dev, case, executor)
    assert all(fxrt.pattern_counts(cg) == {} for cg in built)
