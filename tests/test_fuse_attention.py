"""The attention fusion pass: hand-written attention becomes one fused op, results stay eager's.

Each model is compared against eager on both loops, called twice with different values, through
``torch.compile`` and through ``fxrt.export``/``fxrt.load``; the graphs it must not touch (the
attention weights also returned, a row with every key masked, a mask computed from the inputs,
float64) are checked to keep their ops and to equal eager too.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import native_available, recording_compiles, skip_unless_executor
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.ir import from_fx, verify
from fxrt.models import DecoderBlock
from fxrt.ops.own_ops import available as own_ops_available
from fxrt.passes import eliminate_dead_code, fold_constants, fuse_attention, remove_noops

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
FUSED = "aten::_scaled_dot_product_flash_attention_for_cpu"
# What a compiled graph runs for it: fxrt's own op where the extension is built, else ATen's.
RUNS_FUSED = {FUSED, "fxrt::attention", "fxrt::sdpa"}
UNFUSED = {"aten::bmm", "aten::_softmax", "aten::masked_fill.Scalar"}


class Attention(nn.Module):
    """softmax(q k^T * scale [masked]) v with the masks and scales model code writes: the mask is
    made in forward (a constant once folded) or, with ``mask="input"``, computed from the input."""

    def __init__(
        self, mask: str = "causal", scale: str = "div", dtype=torch.float32, additive=False
    ):
        super().__init__()
        self.mask, self.scale, self.heads, self.additive = mask, scale, 2, additive
        self.qkv = nn.Linear(32, 96, dtype=dtype)
        self.return_weights = False
        self.merge_heads = True
        self.return_heads = False

    def keep(self, x: torch.Tensor) -> torch.Tensor | None:
        s = x.shape[1]
        ones = torch.ones(s, s, dtype=torch.bool, device=x.device)
        return {
            "causal": lambda: ones.tril(),
            "band": lambda: ones.tril() & ~ones.tril(-3),  # each query sees up to 3 keys
            "no_rows": lambda: ones.tril() & ~torch.eye(s, dtype=torch.bool),  # row 0: none
            "input": lambda: x[0, :, :s] > 0,
            "none": lambda: None,
        }[self.mask]()

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        b, s, h = x.shape
        q, k, v = (
            t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(h, -1)
        )
        scores = q @ k.transpose(-2, -1)
        if self.scale == "div":
            scores = scores / math.sqrt(h // self.heads)
        elif self.scale == "mul":
            scores = scores * 0.3
        if self.mask == "alibi":  # a finite bias per distance, added (ALiBi's shape)
            pos = torch.arange(s, device=x.device)
            scores = scores - 0.5 * (pos[:, None] - pos[None]).abs().to(scores.dtype)
        keep = self.keep(x) if self.mask != "alibi" else None
        if keep is not None and self.additive:  # Meta's Llama: scores + mask, -inf where not
            bias = torch.zeros(keep.shape, dtype=scores.dtype).masked_fill(~keep, float("-inf"))
            scores = scores + bias
        elif keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = probs @ v
        merged = out.transpose(1, 2).reshape(b, s, h) if self.merge_heads else out * 2
        if self.return_heads:
            return merged, out
        return (merged, probs) if self.return_weights else merged


def _graph(model: nn.Module, x: torch.Tensor):
    with torch.no_grad():
        g = from_fx(make_fx(model)(x), [x])
    g = fold_constants(g, foldable=frozenset())
    return verify(eliminate_dead_code(fuse_attention(remove_noops(g))))


def _ops(graph) -> set[str]:
    return {n.op.name for n in graph.nodes}


def _compiled(model: nn.Module, executor: str, **options):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    options = {"pure_python": executor == "python", "cache": False, **options}
    return torch.compile(model, backend="fxrt", options=options)


def _check(model: nn.Module, executor: str, *, fused: bool, seq: int = 8, **options) -> None:
    """torch.compile(model) equals eager on two inputs, on ``executor``'s loop; its graph holds
    the fused op or not (never without fxrt's own attention op to run it)."""
    fused = fused and FUSED in own_ops_available() and options.get("own_ops", True)
    torch.manual_seed(0)
    model.eval()
    with recording_compiles() as built, torch.no_grad():
        fn = _compiled(model, executor, **options)
        for _ in range(2):
            x = torch.randn(1, seq, 32, dtype=model.qkv.weight.dtype)
            got, want = fn(x), model(x)
            torch.testing.assert_close(got, want, equal_nan=True)
            for g, w in zip(
                got if isinstance(got, tuple) else (got,),
                want if isinstance(want, tuple) else (want,),
            ):
                assert g.stride() == w.stride()
    assert built and all(cg.executor == executor for cg in built)
    ops = set().union(*(_ops(cg.graph) for cg in built))
    if fused:
        assert RUNS_FUSED & ops and not UNFUSED & ops, sorted(ops)
    else:
        assert not RUNS_FUSED & ops and "aten::_softmax" in ops, sorted(ops)


BAND = torch.ones(8, 8, dtype=torch.bool).tril() & ~torch.ones(8, 8, dtype=torch.bool).tril(-3)


# ----------------------------------------------------------------------------------------------
# The rewrite itself


def test_causal_block_becomes_one_fused_op_and_the_head_merge_copies_nothing():
    g = _graph(DecoderBlock(32, 2).eval(), torch.randn(1, 8, 32))
    fused = [n for n in g.nodes if n.op.name == FUSED]
    assert len(fused) == 1 and not UNFUSED & _ops(g)
    node = fused[0]
    assert node.args[3:] == (0.0, True) and node.kwargs == {"attn_mask": None, "scale": 0.25}
    assert not any(
        isinstance(c, torch.Tensor) and c.dtype == torch.bool for c in g.constants.values()
    )
    # The head merge (transpose, then a contiguous copy) reads the fused output, laid out
    # [B, L, H, D]: the transpose is contiguous, so the copy is a no-op and goes.
    g = eliminate_dead_code(remove_noops(g))
    assert "aten::clone" not in _ops(g)


def test_other_masks_become_an_additive_float_mask():
    g = _graph(Attention("band").eval(), torch.randn(1, 8, 32))
    (node,) = [n for n in g.nodes if n.op.name == FUSED]
    assert node.args[4] is False
    mask = g.constants[node.kwargs["attn_mask"].id]
    want = torch.zeros(8, 8).masked_fill(~BAND, -math.inf)
    torch.testing.assert_close(mask, want.view(1, 1, 8, 8))


def test_no_mask_and_a_multiplied_scale():
    g = _graph(Attention("none", "mul").eval(), torch.randn(1, 8, 32))
    (node,) = [n for n in g.nodes if n.op.name == FUSED]
    assert node.args[4] is False and node.kwargs == {"attn_mask": None, "scale": 0.3}


def test_an_added_mask_is_causal_or_an_additive_float_mask():
    """``scores + m`` with a constant ``m``: the triangle of zeros and -inf is is_causal; any
    other finite-per-row bias the fused op's attn_mask."""
    g = _graph(Attention("causal", additive=True).eval(), torch.randn(1, 8, 32))
    (node,) = [n for n in g.nodes if n.op.name == FUSED]
    assert node.args[4] is True and node.kwargs["attn_mask"] is None
    g = _graph(Attention("band", additive=True).eval(), torch.randn(1, 8, 32))
    (node,) = [n for n in g.nodes if n.op.name == FUSED]
    want = torch.zeros(8, 8).masked_fill(~BAND, -math.inf)
    torch.testing.assert_close(g.constants[node.kwargs["attn_mask"].id], want.view(1, 1, 8, 8))
    g = _graph(Attention("alibi").eval(), torch.randn(1, 8, 32))
    (node,) = [n for n in g.nodes if n.op.name == FUSED]
    pos = torch.arange(8)
    bias = -0.5 * (pos[:, None] - pos[None]).abs().float()
    torch.testing.assert_close(g.constants[node.kwargs["attn_mask"].id], bias.view(1, 1, 8, 8))


@pytest.mark.parametrize("case", ["weights_returned", "no_rows", "input", "float64"])
def test_left_alone(case):
    model = Attention(
        case if case in ("no_rows", "input") else "causal",
        dtype=torch.float64 if case == "float64" else torch.float32,
    )
    model.return_weights = case == "weights_returned"
    x = torch.randn(1, 8, 32, dtype=model.qkv.weight.dtype)
    g = _graph(model.eval(), x)
    assert FUSED not in _ops(g) and "aten::_softmax" in _ops(g)


# ----------------------------------------------------------------------------------------------
# Against eager, both loops


@pytest.mark.parametrize("mask", ["causal", "band", "none"])
@pytest.mark.parametrize("scale", ["div", "mul", "none"])
def test_fused_equals_eager(executor, mask, scale):
    _check(Attention(mask, scale), executor, fused=True)


def test_heads_read_otherwise_get_eager_layout(executor):
    # Read as [B, H, L, D] (not merged through a transpose): a contiguous copy of the fused
    # output keeps the result's strides eager's (checked in _check).
    model = Attention("causal")
    model.merge_heads = False
    _check(model, executor, fused=True)


def test_not_fused_without_own_ops(executor):
    # ATen's flash kernel alone is slower than the unfused ops at these sizes.
    _check(Attention("causal"), executor, fused=False, own_ops=False)


def test_heads_also_returned_keep_eager_layout(executor):
    # The per-head output is merged through transpose + copy and also returned as it is: the
    # caller must get eager's contiguous layout, not the fused op's [B, L, H, D] one.
    model = Attention("causal")
    model.return_heads = True
    _check(model, executor, fused=True)


def test_decoder_block_equals_eager(executor):
    skip_unless_executor(executor)
    torch.manual_seed(0)
    model = DecoderBlock(64, 4).eval()
    with recording_compiles() as built, torch.no_grad():
        fn = _compiled(model, executor)
        for _ in range(2):
            x = torch.randn(1, 12, 64)
            torch.testing.assert_close(fn(x), model(x))
    assert RUNS_FUSED & _ops(built[0].graph) or FUSED not in own_ops_available()


@pytest.mark.parametrize("mask", ["causal", "band", "alibi"])
def test_added_masks_equal_eager(executor, mask):
    _check(Attention(mask, additive=True), executor, fused=True)


@pytest.mark.parametrize("case", ["weights_returned", "no_rows", "input"])
@pytest.mark.parametrize("additive", [False, True], ids=["masked_fill", "added"])
def test_left_alone_equals_eager(executor, case, additive):
    model = Attention("causal" if case == "weights_returned" else case, additive=additive)
    model.return_weights = case == "weights_returned"
    _check(model, executor, fused=False)


def test_exported_decoder_equals_eager_on_both_loops(tmp_path):
    torch.manual_seed(0)
    model = DecoderBlock(128, 4).eval()
    x = torch.randn(1, 16, 128)
    path = tmp_path / "w3.fxrt"
    fxrt.export(model, (x,)).save(path)
    loops = ["python", "cpp"] if native_available() else ["python"]
    for loop in loops:
        m = fxrt.load(path, options={"pure_python": loop == "python"})
        assert m.executor == loop
        assert RUNS_FUSED & _ops(m.graph) or FUSED not in own_ops_available()
        for _ in range(2):
            x = torch.randn(1, 16, 128)
            with torch.no_grad():
                torch.testing.assert_close(m(x), model(x))
