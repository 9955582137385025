"""Built-in passes on golden graphs, user passes (TorchAir interface) and FXRT_DUMP_DIR."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
from conftest import check_against_eager, recording_compiles, skip_unless_executor
from torch.fx.experimental.proxy_tensor import make_fx

import fxrt
from fxrt.ir import from_fx, graph_to_text, verify
from fxrt.models import MLP, DecoderBlock
from fxrt.passes import (
    PassError,
    eliminate_common_subexpressions,
    eliminate_dead_code,
    fold_constants,
    remove_noops,
)

aten = torch.ops.aten


def ir_of(fn, *inputs):
    return verify(from_fx(make_fx(fn)(*inputs), inputs))


def golden(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def test_eliminate_dead_code_keeps_mutations_and_random_ops():
    def f(x, buf):
        unused = x.exp()  # noqa: F841 - dead
        buf.add_(1)  # mutates an input: kept
        torch.ops.aten.bernoulli.default(x)  # draws random numbers: kept
        return x * 2

    g = eliminate_dead_code(ir_of(f, torch.rand(3), torch.zeros(3)))
    assert graph_to_text(g) == golden("""
        graph(%x_1: float32[3], %buf_1: float32[3]):
          %add_: float32[3] = aten::add_.Tensor(%buf_1, 1)
          %bernoulli: float32[3] = aten::bernoulli(%x_1)
          %mul: float32[3] = aten::mul.Tensor(%x_1, 2)
          return %mul
    """)


def test_eliminate_common_subexpressions_on_pure_ops():
    def f(x):
        a, b = x.sin(), x.sin()
        return a + b, (x + 1) * (x + 1)

    g = eliminate_common_subexpressions(ir_of(f, torch.randn(3)))
    assert graph_to_text(eliminate_dead_code(g)) == golden("""
        graph(%x_1: float32[3]):
          %sin: float32[3] = aten::sin(%x_1)
          %add: float32[3] = aten::add.Tensor(%sin, %sin)
          %add_1: float32[3] = aten::add.Tensor(%x_1, 1)
          %mul: float32[3] = aten::mul.Tensor(%add_1, %add_1)
          return (%add, %mul)
    """)


def test_cse_skips_values_written_in_place_and_distinct_outputs():
    def f(x):
        a, b = x + 1, x + 1
        a.mul_(2)  # a is written: merging b into a would change b
        return a, b, x.cos(), x.cos()  # two outputs must stay two tensors

    x = torch.randn(3)
    g = eliminate_common_subexpressions(ir_of(f, x))
    assert [n.op.name for n in g.nodes].count("aten::add.Tensor") == 2
    assert [n.op.name for n in g.nodes].count("aten::cos") == 2


def test_fold_constants_with_size_cap():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.arange(4.0))
            self.register_buffer("big", torch.ones(1024))

        def forward(self, x):
            return x + self.w.exp() * 2, x.sum() + self.big.expand(64, 1024).sum()

    g = fold_constants(ir_of(M(), torch.randn(4)), max_bytes=1024)
    text = graph_to_text(g)
    assert "aten::exp(" not in text and "aten::mul.Tensor" not in text  # folded
    assert "aten::expand(" in text  # a view of the 4 KiB buffer: over the 1 KiB cap, kept
    folded = [c for c in g.constants.values() if isinstance(c, torch.Tensor) and c.numel() == 4]
    torch.testing.assert_close(folded[-1], torch.arange(4.0).exp() * 2)


def test_fold_constants_folds_what_depends_on_no_input():
    # A causal mask built in forward (W3's): the same tensor on every call, folded once. Random
    # factories draw anew each call, and a result the caller receives must be a new tensor each
    # call: both stay.
    def f(x):
        mask = torch.ones(4, 4, dtype=torch.bool).tril()
        noise = torch.randn(4, 4)
        return x.masked_fill(~mask, 0.0) + noise, torch.zeros(4)

    g = verify(
        eliminate_dead_code(fold_constants(ir_of(f, torch.randn(4, 4)), foldable=frozenset()))
    )
    ops = [n.op.name for n in g.nodes]
    assert not {"aten::ones", "aten::tril", "aten::bitwise_not"} & set(ops), ops
    assert "aten::randn" in ops and "aten::zeros" in ops
    masks = [
        c for c in g.constants.values() if isinstance(c, torch.Tensor) and c.dtype == torch.bool
    ]
    assert len(masks) == 1  # the intermediate ones and tril are gone with their last use
    torch.testing.assert_close(masks[0], ~torch.ones(4, 4, dtype=torch.bool).tril())


def test_cse_merges_constants_of_equal_content(executor):
    """Each layer's mask building makes its own scalar literals: equal content is one value, so
    the two where()s merge; a constant that is written keeps its own."""

    def f(x, m):
        a = torch.where(m, torch.tensor(0.0), torch.tensor(float("-inf")))
        b = torch.where(m, torch.tensor(0.0), torch.tensor(float("-inf")))
        c = torch.tensor(0.0)
        c.add_(1)
        return x + a, x * b, x - c

    x, m = torch.randn(3), torch.tensor([True, False, True])
    g = fold_constants(ir_of(f, x, m), foldable=frozenset())
    g = verify(eliminate_dead_code(eliminate_common_subexpressions(g)))
    ops = [n.op.name for n in g.nodes]
    assert ops.count("aten::where.self") == 1, ops
    assert "aten::add_.Tensor" in ops
    check_against_eager(f, (x, m), executor)


def test_folded_causal_mask_through_torch_compile(executor):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DecoderBlock(32, 2).eval()
    options = {"pure_python": executor == "python", "cache": False}
    with recording_compiles() as compiled, torch.no_grad():
        fn = torch.compile(model, backend="fxrt", options=options)
        for _ in range(2):  # two calls, different values
            x = torch.randn(1, 8, 32)
            torch.testing.assert_close(fn(x), model(x))
    assert compiled
    for cg in compiled:
        ops = {n.op.name for n in cg.graph.nodes}
        assert not {"aten::ones", "aten::tril"} & ops, sorted(ops)


def test_folded_causal_mask_in_a_training_graph(executor):
    """AOTAutograd compiles the forward under its fake mode: a folded constant is still a real
    tensor (it was a FakeTensor, and the first call failed in the graph's masked_fill)."""
    skip_unless_executor(executor)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DecoderBlock(32, 2).eval()
    reference = copy.deepcopy(model)
    options = {"pure_python": executor == "python", "cache": False}
    with recording_compiles() as compiled:
        fn = torch.compile(model, backend="fxrt", options=options)
        for _ in range(2):
            x = torch.randn(1, 8, 32)
            out, want = fn(x), reference(x)
            torch.testing.assert_close(out, want)
            out.sum().backward()
            want.sum().backward()
    assert compiled
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_fused_attention_mask_under_aot_autograds_fake_mode(executor):
    """fxrt as AOTAutograd's compiler under inference mode: fuse_attention computes its additive
    mask from the folded causal mask outside AOTAutograd's fake mode (it failed in bitwise_not
    on a real tensor under the fake mode)."""
    from torch._dynamo.backends.common import aot_autograd

    skip_unless_executor(executor)
    torch._dynamo.reset()
    model = DecoderBlock(32, 2).eval()
    config = fxrt.CompilerConfig(pure_python=executor == "python", cache=False)
    backend = aot_autograd(fw_compiler=fxrt.get_compiler(config))
    with recording_compiles() as compiled, torch.inference_mode():
        fn = torch.compile(model, backend=backend)
        for _ in range(2):
            x = torch.randn(1, 8, 32)
            torch.testing.assert_close(fn(x), model(x))
    assert {cg.executor for cg in compiled} == {executor}


def test_fold_constants_never_folds_mutated_buffers():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(1))

        def forward(self, x):
            self.count.add_(1)
            return x * self.count.exp()

    g = fold_constants(ir_of(M(), torch.randn(2)))
    assert "aten::exp" in graph_to_text(g)


def test_remove_noops():
    def f(x):
        a = x.view(2, 3)  # same shape: removed
        b = a.clone()  # never written: removed
        c = b.to(torch.float32)  # same dtype: no node at all after make_fx
        d = torch.ops.aten.alias.default(c)
        e = d * 2
        return e, x.clone()  # the clone the caller receives stays

    g = eliminate_dead_code(remove_noops(ir_of(f, torch.randn(2, 3))))
    assert graph_to_text(g) == golden("""
        graph(%x_1: float32[2, 3]):
          %mul: float32[2, 3] = aten::mul.Tensor(%x_1, 2)
          %clone_1: float32[2, 3] = aten::clone(%x_1)
          return (%mul, %clone_1)
    """)


def test_remove_noops_arithmetic_identities():
    """x * 1 and x / 1 are x bit for bit (rotary embeddings' attention_scaling of 1.0); x + 0 is
    not for floats (-0.0 + 0 is +0.0), so it stays, except on integers (a position offset)."""

    def f(x, i):
        a = x * 1.0
        b = torch.ops.aten.div.Tensor(a, 1)
        c = b + 0  # float: stays
        j = i + 0  # int: removed
        k = i * 1.0  # to float: another dtype, stays
        return torch.sin(b), c, j * 3, k

    g = eliminate_dead_code(remove_noops(ir_of(f, torch.randn(2, 3), torch.arange(3))))
    assert graph_to_text(g) == golden("""
        graph(%x_1: float32[2, 3], %i_1: int64[3]):
          %add: float32[2, 3] = aten::add.Tensor(%x_1, 0)
          %mul_1: float32[3] = aten::mul.Tensor(%i_1, 1.0)
          %sin: float32[2, 3] = aten::sin(%x_1)
          %mul_2: int64[3] = aten::mul.Tensor(%i_1, 3)
          return (%sin, %add, %mul_2, %mul_1)
    """)


def test_clone_that_is_written_later_is_kept():
    def f(x):
        y = x.clone()
        y.add_(1)
        return y * 1

    x = torch.randn(3)
    g = remove_noops(ir_of(f, x))
    assert "aten::clone" in graph_to_text(g)


def test_pass_records_and_explicit_pass_list():
    x = torch.randn(4)
    gm = make_fx(lambda x: (x.sin() + x.sin()).view(4) * 2)(x)
    cg = fxrt.compile_graph(gm, [x], fxrt.CompilerConfig(passes=["eliminate_dead_code"]))
    assert [r.name for r in cg.pass_records] == ["eliminate_dead_code"]
    cg = fxrt.compile_graph(gm, [x])
    names = [r.name for r in cg.pass_records]
    assert names == list(fxrt.CompilerConfig().pass_names())
    changed = {r.name: r.changed for r in cg.pass_records}
    assert changed["eliminate_common_subexpressions"] and changed["remove_noops"]
    assert all(r.seconds >= 0 for r in cg.pass_records)
    cg0 = fxrt.compile_graph(gm, [x], fxrt.CompilerConfig(opt_level=0))
    assert cg0.pass_records == [] and len(cg0.graph.nodes) > len(cg.graph.nodes)
    want = (x.sin() + x.sin()).view(4) * 2
    torch.testing.assert_close(cg(x), want)
    torch.testing.assert_close(cg0(x), want)


def test_unknown_pass_name_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown pass.*valid passes: eliminate_dead_code"):
        fxrt.CompilerConfig(passes=["fuse_everything"])


@pytest.mark.parametrize("opt_level", [0, 1, 2])
@pytest.mark.parametrize("model", ["mlp", "decoder", "decoder_cache"])
def test_passes_leave_model_outputs_unchanged(executor, opt_level, model):
    m, inputs = {
        "mlp": (MLP(32, 2).eval(), (torch.randn(2, 32),)),
        "decoder": (DecoderBlock(32, 2).eval(), (torch.randn(1, 4, 32),)),
        "decoder_cache": (
            DecoderBlock(32, 2, cache_len=8).eval(),
            (torch.randn(1, 2, 32), torch.tensor([3, 4])),
        ),
    }[model]
    with torch.no_grad():
        check_against_eager(m, inputs, executor, options={"opt_level": opt_level})


class ScaledLinear(torch.nn.Module):
    """Weight expressions constant folding could precompute (``(w * 2).t()``, ``b.exp()``)."""

    def __init__(self, n: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n, n))
        self.b = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x @ (self.w * 2).t() + self.b.exp()


@pytest.mark.parametrize("opt_level", [0, 1, 2])
def test_every_opt_level_keeps_weights_live_like_eager(executor, opt_level):
    # A make_fx graph holds the weights as constants; no opt level may fold or freeze them: an
    # in-place update after compiling changes the next result, as in eager.
    skip_unless_executor(executor)
    torch.manual_seed(0)
    m = ScaledLinear(32).eval()
    x = torch.randn(2, 32)
    with torch.no_grad():
        gm = make_fx(m)(x)
        config = fxrt.CompilerConfig(
            pure_python=executor == "python", opt_level=opt_level, cache=False
        )
        cg = fxrt.compile_graph(gm, [x], config)
        torch.testing.assert_close(cg(x), m(x))
        for p in m.parameters():
            p.mul_(1.5)
        torch.testing.assert_close(cg(x), m(x))


def test_user_pre_and_post_pass_are_called_with_documented_arguments():
    calls = []

    def pre(gm, example_inputs, config):
        calls.append(("pre", type(gm), len(example_inputs), type(config)))
        for node in gm.graph.nodes:
            if node.target is aten.relu.default:
                node.target = aten.gelu.default  # takes effect: relu becomes gelu

    def post(gm, example_inputs, config):
        calls.append(("post", type(gm), len(example_inputs), type(config)))
        ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        assert aten.gelu.default in ops and aten.relu.default not in ops

    def f(x):
        return torch.relu(x) * 2

    torch._dynamo.reset()
    x = torch.randn(8)
    opts = {"post_grad_custom_pre_pass": pre, "post_grad_custom_post_pass": post}
    with torch.no_grad():
        out = torch.compile(f, backend="fxrt", options=opts)(x)
    torch.testing.assert_close(out, torch.nn.functional.gelu(x) * 2)
    assert [c[0] for c in calls] == ["pre", "post"]
    assert all(
        c[1] is torch.fx.GraphModule or issubclass(c[1], torch.fx.GraphModule) for c in calls
    )
    assert all(c[2] == 1 and c[3] is fxrt.CompilerConfig for c in calls)


def test_failing_user_pass_names_the_pass():
    def broken_pass(gm, example_inputs, config):
        raise KeyError("boom")

    x = torch.randn(3)
    gm = make_fx(lambda x: x + 1)(x)
    config = fxrt.CompilerConfig(post_grad_custom_pre_pass=broken_pass)
    with pytest.raises(PassError, match=r"post_grad_custom_pre_pass \(.*broken_pass\) failed"):
        fxrt.compile_graph(gm, [x], config)


def test_replace_pattern_helper():
    from fxrt.passes.user import replace_pattern

    def pre(gm, example_inputs, config):
        n = replace_pattern(
            gm,
            lambda a: torch.sigmoid(a) * a,  # SiLU written by hand
            lambda a: torch.nn.functional.silu(a),
            [torch.randn(4)],
        )
        assert n == 1

    def f(x):
        return torch.sigmoid(x) * x + 1

    x = torch.randn(4)
    gm = make_fx(f)(x)
    cg = fxrt.compile_graph(gm, [x], fxrt.CompilerConfig(post_grad_custom_pre_pass=pre))
    assert "aten::silu" in cg.graph_text() and "aten::sigmoid" not in cg.graph_text()
    torch.testing.assert_close(cg(x), f(x))


def test_dump_dir_holds_every_stage(tmp_path, monkeypatch):
    monkeypatch.setenv("FXRT_DUMP_DIR", str(tmp_path))
    x = torch.randn(4)
    gm = make_fx(lambda x: (x.sin() + x.sin()).relu())(x)
    config = fxrt.CompilerConfig(post_grad_custom_pre_pass=lambda gm, ex, cfg: None)
    fxrt.compile_graph(gm, [x], config)
    (folder,) = tmp_path.iterdir()
    names = sorted(p.name for p in folder.iterdir())
    assert names[:2] == ["00_input_fx.txt", "01_after_pre_pass_fx.txt"]
    for p in config.pass_names():
        assert any(n.endswith(f"after_{p}.txt") for n in names)
    assert {"ir.txt", "program.txt", "ir.dot"} <= set(names)
    assert "FREE" in (folder / "program.txt").read_text()
    assert (folder / "ir.dot").read_text().startswith("digraph fxrt {")
    assert (
        "aten::sin" in (folder / "00_input_fx.txt").read_text()
        or "sin" in (folder / "00_input_fx.txt").read_text()
    )


def test_model_tests_run_the_passes():
    with recording_compiles() as built, torch.no_grad():
        torch._dynamo.reset()
        m = copy.deepcopy(MLP(16, 1).eval())
        torch.compile(m, backend="fxrt")(torch.randn(1, 16))
    assert built and built[0].pass_records


def test_the_config_names_every_builtin_pass():
    """fxrt.config validates ``passes`` and ``opt_level`` without importing a pass: its names
    are fxrt.passes.PASSES's, in order, and every level runs only those."""
    from fxrt.config import LEVELS, PASS_NAMES
    from fxrt.passes import PASSES

    assert tuple(PASSES) == PASS_NAMES
    assert all(set(names) <= set(PASS_NAMES) for names in LEVELS.values())
