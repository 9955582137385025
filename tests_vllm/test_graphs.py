"""fxrt.vllm.graphs.FxrtGraphWrapper, vLLM's static graph wrapper over fxrt's capture, on the
test suite's stand-in accelerator (tests/standin): inside vLLM's forward context with the
wrapper's mode it captures once per padded batch size and replays; in any other mode it runs the
compiled loop; answers are eager's on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


@pytest.fixture(scope="module")
def dev():
    import standin

    try:
        return standin.load()
    except standin.Unavailable as e:
        pytest.skip(str(e))


def step(x, w, cache, pos):
    y = torch.nn.functional.silu(x @ w) + x
    cache.index_copy_(0, pos, y[:, :4])  # a KV-cache-like write in place
    return y.sum(-1)


@pytest.mark.parametrize("executor", ["cpp", "python"])
def test_captures_once_per_batch_size_and_replays(dev, executor):
    import standin
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.forward_context import BatchDescriptor, set_forward_context

    import fxrt
    from fxrt.vllm.graphs import FxrtGraphWrapper

    device = torch.device(standin.name(), 0)
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    cache = torch.zeros(16, 4)

    def inputs(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 8, generator=g), torch.arange(n) % 16

    x, pos = inputs(3, 0)
    on = [t.to(device) for t in (x, w, cache, pos)]
    config = fxrt.CompilerConfig(cache=False, pure_python=executor == "python")
    # Symbolic sizes, as vLLM compiles: one graph for every batch size.
    compiled = fxrt.compile_graph(make_fx(step, tracing_mode="symbolic")(*on), on, config)
    vllm_config = VllmConfig()
    wrapper = FxrtGraphWrapper(compiled.entry(), vllm_config, CUDAGraphMode.FULL)
    eager_cache, device_cache = cache.clone(), cache.to(device)

    def call(n, seed, mode):
        x, pos = inputs(n, seed)
        want = step(x, w, eager_cache, pos)
        descriptor = BatchDescriptor(num_tokens=n)
        with set_forward_context(None, vllm_config, cudagraph_runtime_mode=mode,
                                 batch_descriptor=descriptor):  # fmt: skip
            got = wrapper(x.to(device), w.to(device), device_cache, pos.to(device))
        torch.testing.assert_close(got.cpu(), want)
        torch.testing.assert_close(device_cache.cpu(), eager_cache)

    for seed in range(4):  # a warm-up call, the capture, replays
        call(3, seed, CUDAGraphMode.FULL)
    for seed in range(3):
        call(6, 10 + seed, CUDAGraphMode.FULL)
    call(3, 20, CUDAGraphMode.NONE)  # vLLM's profile and warm-up runs: the loop
    call(6, 21, CUDAGraphMode.PIECEWISE)  # another wrapper's mode: the loop
    report = wrapper.captured.capture_report()
    assert report.captured == 2, str(report)
    assert wrapper.batch_descriptors == {
        BatchDescriptor(num_tokens=3),
        BatchDescriptor(num_tokens=6),
    }
    replays = sum(s.replays for s in report.signatures)
    assert replays >= 3, str(report)


def test_a_runnable_that_is_not_fxrts_runs_as_it_is():
    from vllm.config import CUDAGraphMode, VllmConfig

    from fxrt.vllm.graphs import FxrtGraphWrapper

    wrapper = FxrtGraphWrapper(lambda x: x + 1, VllmConfig(), CUDAGraphMode.FULL)
    assert wrapper.captured is None and wrapper(torch.ones(2)).tolist() == [2.0, 2.0]
    with pytest.raises(ValueError, match="runtime mode other than NONE"):
        FxrtGraphWrapper(lambda x: x, VllmConfig(), CUDAGraphMode.NONE)
