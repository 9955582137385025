"""Whole models compiled with backend="fxrt" on both loops, against eager."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import check_against_eager, compile_and_run
from torch import nn

from fxrt.models import MLP, DecoderBlock, OpChain


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        x = torch.relu(self.bn2(self.conv2(x)))
        x = torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


class WithConstants(nn.Module):
    """Captures a plain tensor attribute and a buffer as constants."""

    def __init__(self):
        super().__init__()
        self.scale = torch.linspace(0.5, 2.0, 8)
        self.register_buffer("shift", torch.arange(8.0))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x * self.scale + self.shift)


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad", "enabled"])
def test_mlp(executor, grad_mode):
    model, x = MLP(64, 3).eval(), torch.randn(2, 64)
    ctx = {
        "inference_mode": torch.inference_mode,
        "no_grad": torch.no_grad,
        "enabled": torch.enable_grad,
    }[grad_mode]
    with ctx():
        check_against_eager(model, (x,), executor)


def test_convnet_eval(executor):
    model = ConvNet().eval()
    with torch.no_grad():
        # give batchnorm non-trivial running statistics
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
        check_against_eager(model, (torch.randn(2, 3, 16, 16),), executor)


def test_convnet_train_mode_updates_running_stats(executor):
    # Training-mode batchnorm mutates its buffers: the compiled graph must write them back.
    check_against_eager(ConvNet().train(), (torch.randn(4, 3, 16, 16),), executor)


def test_op_chain(executor):
    with torch.no_grad():
        check_against_eager(OpChain(40), (torch.randn(1, 64),), executor)


def test_decoder_block(executor):
    with torch.no_grad():
        check_against_eager(DecoderBlock(64, 4).eval(), (torch.randn(2, 8, 64),), executor)


def test_decoder_block_kv_cache(executor):
    """Three decode steps; the KV cache is updated in place with index_copy_ each step."""
    eager = DecoderBlock(64, 4, cache_len=16).eval()
    compiled_model = copy.deepcopy(eager)
    steps = [(torch.randn(1, 4, 64), torch.arange(4 * i, 4 * i + 4)) for i in range(3)]
    with torch.no_grad():
        for i, (x, pos) in enumerate(steps):
            expected = eager(x, pos)
            if i == 0:
                got = compile_and_run(compiled_model, (x, pos), executor)
                compiled = torch.compile(
                    compiled_model, backend="fxrt", options={"pure_python": executor == "python"}
                )
            else:
                got = compiled(x, pos)
            torch.testing.assert_close(got, expected)
            torch.testing.assert_close(compiled_model.k_cache, eager.k_cache)
            torch.testing.assert_close(compiled_model.v_cache, eager.v_cache)
    assert eager.k_cache[:, :, :12].abs().sum() > 0


def test_constants_captured_as_attributes(executor):
    with torch.no_grad():
        check_against_eager(WithConstants().eval(), (torch.randn(3, 8),), executor)


def test_outputs_that_are_views_of_inputs(executor):
    def f(x, y):
        return x.t(), x[1:], y.view(-1), x + 1

    x, y = torch.randn(4, 3), torch.randn(2, 3)
    out = compile_and_run(f, (x, y), executor)
    torch.testing.assert_close(out, f(x, y))
    assert out[0].data_ptr() == x.data_ptr() and out[0]._base is x
    assert out[1]._base is x and out[2]._base is y
    x.add_(1)  # the views see writes to their base, as in eager
    torch.testing.assert_close(out[0], x.t())


def test_outputs_aliasing_each_other(executor):
    def f(x):
        y = x * 2
        return y, y.view(-1), y[0]

    x = torch.randn(3, 4)
    a, b, c = compile_and_run(f, (x,), executor)
    torch.testing.assert_close((a, b, c), f(x))
    a.add_(1)  # all three share one storage, as in eager
    torch.testing.assert_close(b, a.view(-1))
    torch.testing.assert_close(c, a[0])


def test_multiple_tuple_and_none_outputs(executor):
    def f(x):
        v, i = x.max(dim=1)
        return (v, None, (i, x.sum()), [x.mean()])

    x = torch.randn(5, 7)
    out = compile_and_run(f, (x,), executor)
    torch.testing.assert_close(out, f(x))
    assert out[1] is None


def test_input_mutation(executor):
    def f(cache, x, idx):
        cache.index_copy_(0, idx, x)
        buf = cache[:2]
        buf.mul_(2)
        return cache.sum(dim=0)

    cache, x, idx = torch.zeros(6, 4), torch.randn(2, 4), torch.tensor([1, 4])
    check_against_eager(f, (cache, x, idx), executor)


def test_inplace_on_intermediate(executor):
    def f(x):
        y = x * 3
        y.relu_()
        z = y.view(2, -1)
        z.add_(1)
        return y

    check_against_eager(f, (torch.randn(2, 6),), executor)


def test_scalar_and_none_inputs(executor):
    def f(x, s, n):
        return x * s if n is None else x

    x = torch.randn(3)
    torch.testing.assert_close(compile_and_run(f, (x, 2.5, None), executor), f(x, 2.5, None))


def test_autograd_forward_and_backward(executor):
    model = MLP(32, 2)
    x = torch.randn(4, 32, requires_grad=True)
    ref_model, ref_x = copy.deepcopy(model), x.detach().clone().requires_grad_()
    ref_model(ref_x).pow(2).sum().backward()
    from conftest import recording_compiles, skip_unless_executor

    skip_unless_executor(executor)
    torch._dynamo.reset()
    with recording_compiles() as built:
        compiled = torch.compile(
            model, backend="fxrt", options={"pure_python": executor == "python"}
        )
        compiled(x).pow(2).sum().backward()
    assert len(built) == 2, "forward and backward graphs both run on fxrt"
    torch.testing.assert_close(x.grad, ref_x.grad)
    for p, rp in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, rp.grad)


def test_dynamic_shapes_one_compile_many_sizes(executor):
    def f(x):
        return (x.view(x.shape[0], -1) * 2).softmax(-1)

    from conftest import recording_compiles, skip_unless_executor

    skip_unless_executor(executor)
    torch._dynamo.reset()
    with recording_compiles() as built:
        compiled = torch.compile(
            f, backend="fxrt", dynamic=True, options={"pure_python": executor == "python"}
        )
        for n in (2, 3, 5, 9):
            x = torch.randn(n, 3, 4)
            torch.testing.assert_close(compiled(x), f(x))
    assert len(built) == 1


def test_higher_order_cond_runs_as_fallback(executor):
    def f(x, y):
        return torch.cond(x.sum() > 0, lambda a: a.sin() * 2, lambda a: a.cos(), (x + y,))

    for sign in (1.0, -1.0):
        x, y = torch.rand(3) * sign, torch.randn(3)
        torch.testing.assert_close(compile_and_run(f, (x, y), executor), f(x, y))


def test_symint_inputs(executor):
    def f(x, n):
        return x.view(n, -1) * n

    x = torch.randn(6, 2)
    for n in (2, 3):
        torch.testing.assert_close(compile_and_run(f, (x, n), executor, dynamic=True), f(x, n))
