"""Multi-stream programs on a device (the stand-in accelerator, tests/standin): each label runs
on a stream of the device's pool, records and waits are device events, and the side streams lag
(the delay knob) so that a missing wait, a stream not restored or memory reused too early gives
a wrong answer. Both loops, against eager on the CPU, every call read back to the host."""

from __future__ import annotations

from typing import Any

import standin
import torch
from conftest import recording_compiles
from test_standin_fxrt import compiled_on_device, to_device
from test_streams import TwoBranches, torchair_example, torchair_pre_pass, unsynchronized

import fxrt


def run_on_device(fn: Any, calls: list[tuple], dev: Any, executor: str, **options: Any) -> list:
    compiled = compiled_on_device(fn, executor, **options)
    main = dev.current_stream()
    outs = []
    with recording_compiles() as built, dev.delay(3_000):  # side streams lag 3 ms a task
        for inputs in calls:
            got = compiled(*to_device(inputs))
            assert dev.current_stream() == main  # the caller's stream is current again
            outs.append(got.cpu())  # waits for the caller's stream only
    assert built and all(cg.program.streams is not None for cg in built)
    assert {cg.program.streams.device for cg in built} == {standin.name()}
    return outs


def test_torchair_example_on_device(dev, executor):
    calls = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(3)]
    outs = run_on_device(
        torchair_example, calls, dev, executor, post_grad_custom_pre_pass=torchair_pre_pass
    )
    for got, inputs in zip(outs, calls):
        torch.testing.assert_close(got, torchair_example(*inputs))


def test_inserted_syncs_on_device(dev, executor):
    calls = [(torch.randn(4, 4), torch.randn(4, 4)) for _ in range(3)]
    outs = run_on_device(unsynchronized, calls, dev, executor)
    for got, inputs in zip(outs, calls):
        torch.testing.assert_close(got, unsynchronized(*inputs))


def test_stream_scope_model_on_device(dev, executor):
    torch.manual_seed(0)
    model = TwoBranches().eval()
    on_device = TwoBranches().eval()
    on_device.load_state_dict(model.state_dict())
    on_device = on_device.to(standin.name())
    calls = [(torch.randn(2, 32),) for _ in range(3)]
    with torch.no_grad():
        outs = run_on_device(on_device, calls, dev, executor)
        for got, inputs in zip(outs, calls):
            torch.testing.assert_close(got, model(*inputs))


def test_streams_auto_on_device(dev, executor):
    from fxrt.models import MoE

    torch.manual_seed(0)
    model = MoE(64, 4).eval()
    on_device = MoE(64, 4).eval()
    on_device.load_state_dict(model.state_dict())
    on_device = on_device.to(standin.name())
    calls = [(torch.randn(2, 64),) for _ in range(2)]
    compiled = compiled_on_device(on_device, executor, streams="auto")
    with torch.no_grad(), dev.delay(3_000):
        for inputs in calls:
            torch.testing.assert_close(compiled(*to_device(inputs)).cpu(), model(*inputs))


def test_stream_scope_model_captured(dev, executor):
    """Whole-graph capture of a multi-stream program: the side streams join the capture through
    their waits, and replays equal eager."""
    torch.manual_seed(0)
    model = TwoBranches().eval()
    on_device = TwoBranches().eval()
    on_device.load_state_dict(model.state_dict())
    on_device = on_device.to(standin.name())
    compiled = compiled_on_device(on_device, executor, capture=True)
    results = []
    with torch.no_grad(), recording_compiles() as built, dev.delay(3_000):
        for _ in range(5):  # side streams lag 3 ms a task: a missing join gives a wrong answer
            x = torch.randn(2, 32)
            results.append((compiled(*to_device((x,))), model(x)))
        for got, want in results:
            torch.testing.assert_close(got.cpu(), want)
    report = built[0].capture_report()
    [sig] = report.signatures
    assert sig.captured and sig.replays == 4 and not report.regions, str(report)


def with_host_tensor(x: torch.Tensor) -> torch.Tensor:
    with fxrt.stream_scope("side"):
        a = x.sin() + x.cpu().sum(0).to(x.device)  # a CPU tensor: not capturable
    return a * x.cos()


def test_multi_stream_graph_that_cannot_be_captured_runs_the_loop(dev, executor):
    compiled = compiled_on_device(with_host_tensor, executor, capture=True)
    with recording_compiles() as built:
        for _ in range(3):
            x = torch.randn(4, 8)
            torch.testing.assert_close(compiled(*to_device((x,))).cpu(), with_host_tensor(x))
    assert "multi-stream" in str(built[0].capture_report())
