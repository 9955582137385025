"""``streams="auto"`` against eager on both loops: a dense MoE block (experts on streams), a
parallel-residual block (attention and MLP on streams); graphs without branches worth a stream
are unchanged."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from conftest import recording_compiles, skip_unless_executor
from torch import nn

from fxrt.ir import graph_to_text
from fxrt.models import MoE, OpChain, ParallelResidual, workloads


def compile_auto(model: nn.Module, executor: str, **options):
    skip_unless_executor(executor)
    torch._dynamo.reset()
    opts = {"pure_python": executor == "python", "cache": False, "streams": "auto", **options}
    return torch.compile(model, backend="fxrt", options=opts)


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: MoE(256, 4), (1, 256)),
        (lambda: MoE(256, 4), (4, 256)),
        (lambda: ParallelResidual(256), (1, 8, 256)),
    ],
    ids=["moe-b1", "moe-b4", "parallel-residual"],
)
def test_auto_streams_equal_eager(executor, make, shape):
    torch.manual_seed(0)
    model = make().eval()
    fn = compile_auto(model, executor)
    with torch.no_grad(), recording_compiles() as built:
        for _ in range(3):
            x = torch.randn(shape)
            torch.testing.assert_close(fn(x), model(x))
    (cg,) = built
    assert cg.program.streams is not None, str(cg.program)
    assert any(label and label.startswith("auto") for label in cg.program.streams.labels)


def test_max_streams_one_is_one_stream(executor):
    fn = compile_auto(MoE(256, 4).eval(), executor, max_streams=1)
    with torch.no_grad(), recording_compiles() as built:
        fn(torch.randn(1, 256))
    assert built[0].program.streams is None


def test_graph_without_branches_is_unchanged(executor):
    model = OpChain(40).eval()
    x = torch.randn(1, 64)
    texts = []
    for streams in ("auto", "manual"):
        fn = compile_auto(model, executor, streams=streams)
        with torch.no_grad(), recording_compiles() as built:
            torch.testing.assert_close(fn(x), model(x))
        texts.append(graph_to_text(built[0].graph))
    assert texts[0] == texts[1]


@pytest.mark.parametrize("name", list(workloads()))
def test_workloads_run_the_same_program_with_auto_streams(executor, name):
    # What benchmarks/streams.py times for W1-W3: streams="auto" finds no branch worth a stream
    # there, so the program (and its cost) is the default one, instruction for instruction.
    model, inputs = workloads()[name]
    listings = []
    for streams in ("auto", "manual"):
        fn = compile_auto(model, executor, streams=streams)
        with torch.no_grad(), recording_compiles() as built:
            torch.testing.assert_close(fn(*inputs), model(*inputs))
        listings.append(str(built[0].program))
    assert listings[0] == listings[1]
