"""The fused patterns' NPU targets, selected on the stand-in device: stand-in kernels registered
under torch_npu's op names (``npu::npu_rms_norm``, ...; a written-out LayerNorm becomes
``aten::native_layer_norm``, which torch_npu computes fused), the stand-in's device type mapped
to the NPU targets (``fxrt.patterns.use_targets_of``), and the same blocks as tests/test_patterns.py
compiled on the device: the graph calls the vendor's ops, chosen at compile time, and equals
eager on the CPU, on both loops. Without the mapping the device has no targets and keeps the ATen
ops. torch_npu itself is never imported.
"""

from __future__ import annotations

import os

import pytest
import standin
import torch
import torch.nn.functional as F
from conftest import recording_compiles, run_child, skip_unless_executor
from test_layer_norm_chain import WrittenNorm
from test_patterns import RepeatKV, Residual, RMSNorm, Rope, _cos_sin, rotate_half, rotate_pairs
from test_patterns_complex import Rope as ComplexRope
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
    _lib.define(
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, "
        "str input_layout, Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, "
        "float scale=1., float keep_prob=1., int pre_tockens=2147483647, "
        "int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
        "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        'bool gen_mask_parallel=True, bool sync=False, str softmax_layout="") '
        "-> (Tensor, Tensor, Tensor, Tensor, int, int, int)"
    )

    def rms(x, gamma, eps=1e-6):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return gamma * (x * rstd), rstd

    def add_rms(x1, x2, gamma, eps=1e-6):
        x = x1 + x2
        y, rstd = rms(x, gamma, eps)
        return y, rstd, x

    def rotary(x, cos, sin, mode="half"):
        assert mode in ("half", "interleave") and x.dim() == 4 == cos.dim() == sin.dim()
        return x * cos + (rotate_half(x) if mode == "half" else rotate_pairs(x)) * sin

    def attention(q, k, v, head_num, input_layout, pse=None, padding_mask=None,
                  atten_mask=None, scale=1.0, keep_prob=1.0, *rest, sparse_mode=0,
                  **kw):  # fmt: skip
        # BNSD, K/V heads shared by groups of query heads; atten_mask True: masked out
        assert input_layout == "BNSD" and head_num == q.shape[1] and keep_prob == 1.0
        assert pse is None and padding_mask is None and sparse_mode == 0 and not rest
        assert atten_mask is None or atten_mask.dtype == torch.bool
        n = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(n, 1) for t in (k, v))
        s = (q @ k.transpose(-2, -1)) * scale
        if atten_mask is not None:
            s = s.masked_fill(atten_mask, float("-inf"))
        top = s.amax(-1, keepdim=True)
        return s.softmax(-1) @ v, top, top, top.new_empty(0), 0, 0, 0

    def swiglu(x, dim=-1):
        a, b = x.chunk(2, dim)
        return F.silu(a) * b

    for name, fn in [("npu_rms_norm", rms), ("npu_add_rms_norm", add_rms),
                     ("npu_rotary_mul", rotary), ("npu_swiglu", swiglu),
                     ("npu_fusion_attention", attention)]:  # fmt: skip
        _lib.impl(name, fn, "PrivateUse1")


class FusedGateUp(nn.Module):
    """Phi-3's MLP: one projection, chunked into gate and up."""

    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(32, 128), nn.Linear(64, 32)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class Causal(nn.Module):
    """Grouped-query causal attention as transformers calls SDPA without a mask
    (``enable_gqa``: the math spelling repeats the heads itself)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 64)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([32, 16, 16], -1)
        q = q.view(b, s, 4, 8).transpose(1, 2)
        k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _rope(form: str) -> nn.Module:
    """tests/test_patterns_complex.py's block, its frequency table a buffer (moved with it)."""
    model = ComplexRope(form)
    table = model.freqs
    del model.freqs
    model.register_buffer("freqs", table)
    return model


def _x(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _keep(seed: int, *shape: int) -> torch.Tensor:
    """A boolean keep-mask, every row keeping its first key."""
    keep = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > 0.4
    keep[..., 0] = True
    return keep


CASES = {
    # LayerNorm written out: aten's own layer norm, which torch_npu runs as one fused kernel
    "layer_norm": (
        lambda: WrittenNorm("convnext"),
        lambda s: (_x(s, 2, 7, 64),),
        {"layer_norm": 1},
    ),
    "rms_norm": (lambda: RMSNorm(), lambda s: (_x(s, 2, 7, 32),), {"rms_norm": 1}),
    "add_rms_norm": (
        lambda: Residual(),
        lambda s: (_x(s, 2, 5, 32), _x(s + 7, 2, 5, 32)),
        {"add_rms_norm": 2},
    ),
    "rotary": (
        lambda: Rope(),
        lambda s: (_x(s, 2, 6, 32), *_cos_sin(6, 8, s)),
        {"rotary": 2, "gqa_attention": 1},  # and its causal grouped-query attention
    ),
    "gated_mlp": (lambda: FusedGateUp(), lambda s: (_x(s, 3, 32),), {"gated_mlp": 1}),
    # Meta's complex product and gpt-fast's real pairs: one kernel call per tensor
    "rotary_complex": (
        lambda: _rope("complex"),
        lambda s: (_x(s, 2, 6, 32),),
        {"rotary_complex": 2},
    ),
    "rotary_pairs": (lambda: _rope("pairs"), lambda s: (_x(s, 2, 6, 32),), {"rotary_complex": 2}),
    "gqa_attention": (
        lambda: RepeatKV(),
        lambda s: (_x(s, 2, 6, 32), _keep(s, 6, 6)),
        {"gqa_attention": 1},
    ),
    "gqa_attention_bshd": (
        lambda: RepeatKV("bshd"),
        lambda s: (_x(s, 2, 6, 32), _keep(s, 2, 1, 6, 6)),
        {"gqa_attention": 1},
    ),
    "gqa_causal": (lambda: Causal(), lambda s: (_x(s, 2, 6, 32),), {"gqa_attention": 1}),
}
NPU_OPS = {"layer_norm": "aten::native_layer_norm", "rms_norm": "npu::npu_rms_norm",
           "add_rms_norm": "npu::npu_add_rms_norm",
           "rotary": "npu::npu_rotary_mul", "gated_mlp": "npu::npu_swiglu",
           "rotary_complex": "npu::npu_rotary_mul", "rotary_pairs": "npu::npu_rotary_mul",
           "gqa_attention": "npu::npu_fusion_attention",
           "gqa_attention_bshd": "npu::npu_fusion_attention",
           "gqa_causal": "npu::npu_fusion_attention"}  # fmt: skip


def models(case: str) -> tuple[nn.Module, nn.Module]:
    """The case's block on the CPU (eager's answers) and the same weights on the device."""
    make = CASES[case][0]
    torch.manual_seed(0)
    model = make()
    on_device = make()
    on_device.load_state_dict(model.state_dict())
    return model, on_device.to(standin.name())


def _run(dev, case: str, executor: str) -> list[fxrt.CompiledGraph]:
    skip_unless_executor(executor)
    inputs = CASES[case][1]
    model, on_device = models(case)
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


@pytest.mark.parametrize("case", ["gqa_attention", "gqa_causal"])
def test_npu_attention_masks_in_the_kernels_convention(dev, case, executor):
    """The kernel masks out where the graph's mask keeps: a mask the caller passes is negated
    before each call; the causal mask, folded to a constant, once, at compile time."""
    _define_npu_ops()
    use_targets_of(standin.name(), "npu")
    try:
        built = _run(dev, case, executor)
    finally:
        use_targets_of(standin.name(), None)
    ops = [n.op.name for cg in built for n in cg.graph.nodes]
    assert ops.count("aten::logical_not") == (case == "gqa_attention")
    assert "aten::eq.Scalar" not in ops and "aten::_safe_softmax" not in ops
    masks = [c for cg in built for c in cg.graph.constants.values() if c.dtype == torch.bool]
    if case == "gqa_causal":
        assert len(masks) == 1 and torch.equal(masks[0].cpu(), torch.ones(6, 6).triu(1).bool())


class FloatMask(nn.Module):
    """Grouped-query attention under an additive float mask (ALiBi-like): no boolean mask
    says what it keeps."""

    def __init__(self):
        super().__init__()
        self.inner = RepeatKV()

    def forward(self, x, bias):
        return self.inner(x, bias)


def test_npu_attention_keeps_the_aten_ops_for_a_float_mask(dev, executor):
    _define_npu_ops()
    use_targets_of(standin.name(), "npu")
    CASES["float_mask"] = (lambda: FloatMask(), lambda s: (_x(s, 2, 6, 32), _x(s + 1, 6, 6)), {})
    try:
        built = _run(dev, "float_mask", executor)
    finally:
        use_targets_of(standin.name(), None)
        del CASES["float_mask"]
    assert all(fxrt.pattern_counts(cg) == {} for cg in built)


WARM = """
import json, sys
import torch
import standin
standin.load()
import fxrt
from conftest import recording_compiles
from fxrt.patterns import use_targets_of
from test_standin_patterns import CASES, _define_npu_ops, models

_define_npu_ops()
use_targets_of(standin.name(), "npu")
counts, ops = [], set()
for case in ("rotary_complex", "gqa_causal"):
    inputs = CASES[case][1]
    model, on_device = models(case)
    torch._dynamo.reset()
    compiled = torch.compile(on_device, backend="fxrt")
    with recording_compiles() as built, torch.no_grad():
        for seed in (0, 1):
            args = inputs(seed)
            got, want = compiled(*(a.to(standin.name()) for a in args)), model(*args)
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            for g, e in zip(got, want):
                torch.testing.assert_close(g.cpu(), e, rtol=1e-5, atol=1e-5)
    counts += [fxrt.pattern_counts(cg) for cg in built]
    ops |= {n.op.name for cg in built for n in cg.graph.nodes}
print(json.dumps({"counts": counts, "npu": sorted(o for o in ops if o.startswith("npu::")),
                  "stats": dict(fxrt.cache.stats)}))
"""


def test_npu_targets_cold_then_warm(dev, executor, tmp_path):
    """A second process on the same cache directory hits, and its graphs call the same
    vendor ops (a folded mask included) with eager's values."""
    skip_unless_executor(executor)
    env = {"PYTHONPATH": os.path.dirname(__file__)}
    cold = run_child(WARM, tmp_path, executor, env=env)
    warm = run_child(WARM, tmp_path, executor, env=env)
    assert cold["stats"].get("hit", 0) == 0 and warm["stats"].get("hit", 0) >= 2, (cold, warm)
    assert cold["counts"] == warm["counts"] == [{"rotary_complex": 2}, {"gqa_attention": 1}]
    assert cold["npu"] == warm["npu"] == ["npu::npu_fusion_attention", "npu::npu_rotary_mul"]


# tiny transformers decoders on the device: their norms, rotary embeddings and SDPA (which
# traces to its math there) take the vendor's ops; the MLP's separate gate and up projections
# are no swiglu's halves, Gemma's (1 + w) weight no npu_rms_norm's
DECODERS = {
    "llama": {"add_rms_norm": 4, "gqa_attention": 2, "rms_norm": 1, "rotary": 4},
    "qwen2": {"add_rms_norm": 4, "gqa_attention": 2, "rms_norm": 1, "rotary": 4},
    "gemma": {"gqa_attention": 2, "rotary": 4},
}


@pytest.mark.parametrize("name", list(DECODERS))
def test_npu_targets_on_transformers_decoders(dev, name, executor):
    import copy

    from clients_child import build, input_ids

    skip_unless_executor(executor)
    _define_npu_ops()
    use_targets_of(standin.name(), "npu")
    try:
        torch._dynamo.reset()
        model = build(name)
        on_device = copy.deepcopy(model).to(standin.name())
        compiled = torch.compile(
            on_device, backend="fxrt",
            options={"pure_python": executor == "python", "cache": False},
        )  # fmt: skip
        with recording_compiles() as built, torch.no_grad():
            for batch, length in ((1, 7), (2, 7)):
                ids = input_ids(batch, length)
                got = compiled(ids.to(standin.name())).logits.cpu()
                torch.testing.assert_close(got, model(ids).logits, rtol=1e-4, atol=1e-4)
    finally:
        use_targets_of(standin.name(), None)
    # the second batch size recompiles with dynamic sizes: the same fused calls
    assert len(built) == 2
    assert [fxrt.pattern_counts(cg) for cg in built] == [DECODERS[name]] * 2
    ops = {n.op.name for cg in built for n in cg.graph.nodes}
    assert "npu::npu_fusion_attention" in ops and "aten::_safe_softmax" not in ops
