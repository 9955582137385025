"""Each mode in which vLLM takes a backend, with fxrt: greedy tokens equal vLLM eager's, on both
of fxrt's loops, and a restart that loads what the first start compiled."""

from __future__ import annotations

import pytest
from conftest import run_llm

TRACE_ONCE = {"compilation_config": {"mode": 2, "backend": "fxrt"}}


@pytest.mark.parametrize("executor", ["cpp", "python"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_trace_once_aot_compile_and_warm_restart(tmp_path, model_dir, eager_tokens, arch, executor):
    # vLLM's default: aot_compile, the artifact saved in vLLM's cache and loaded on a restart.
    env = {"FXRT_PURE_PYTHON": "1" if executor == "python" else "0"}
    cold = run_llm(tmp_path, model_dir(arch), llm=TRACE_ONCE, env=env)
    assert cold["tokens"] == eager_tokens(arch)
    assert cold["fxrt"]["compiled"] == 1 and cold["fxrt"]["executor"] == executor, cold
    assert cold["fxrt"]["aot"] == ["GraphLoop" if executor == "cpp" else "CompiledGraph"], cold
    warm = run_llm(tmp_path, model_dir(arch), llm=TRACE_ONCE, env=env)
    assert warm["tokens"] == eager_tokens(arch)
    # vLLM loaded its artifact: no Dynamo trace, nothing compiled or even looked up by fxrt.
    assert warm["fxrt"].get("compiled", 0) == 0 and warm["fxrt"].get("hit", 0) == 0, warm
    assert warm["fxrt"]["aot"] == cold["fxrt"]["aot"], warm


@pytest.mark.parametrize("backend", ["fxrt", "fxrt.backend.backend"])
def test_trace_once_without_aot_compile(tmp_path, model_dir, eager_tokens, backend):
    # Dynamo's own path (VLLM_USE_AOT_COMPILE=0); the backend by name or by qualified name.
    # A restart traces again and hits fxrt's cache: the layer names key by value.
    llm = {"compilation_config": {"mode": 2, "backend": backend}}
    env = {"VLLM_USE_AOT_COMPILE": "0"}
    cold = run_llm(tmp_path, model_dir("llama"), llm=llm, env=env)
    assert cold["tokens"] == eager_tokens("llama")
    assert cold["fxrt"]["compiled"] == 1 and cold["fxrt"].get("uncached", 0) == 0, cold
    warm = run_llm(tmp_path, model_dir("llama"), llm=llm, env=env)
    assert warm["tokens"] == eager_tokens("llama")
    assert warm["fxrt"].get("compiled", 0) == 0 and warm["fxrt"]["hit"] == 1, warm


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_piecewise_with_fxrt_platform_and_warm_restart(tmp_path, model_dir, eager_tokens, arch):
    # FXRT_VLLM=1: vLLM's default mode (VLLM_COMPILE) splits the model at attention and fxrt's
    # CompilerInterface compiles each piece; a restart loads each from fxrt's cache by handle.
    env = {"FXRT_VLLM": "1", "FXRT_LOG": "info"}
    cold = run_llm(tmp_path, model_dir(arch), env=env)
    assert cold["tokens"] == eager_tokens(arch)
    assert cold["platform"] == "FxrtCpuPlatform"
    assert "vLLM compiles piecewise with fxrt" in cold["log"]
    pieces = cold["fxrt"]["compiled"]
    assert pieces == 3 and cold["fxrt"]["stored"] == pieces, cold["fxrt"]  # 2 layers: 3 pieces
    warm = run_llm(tmp_path, model_dir(arch), env=env)
    assert warm["tokens"] == eager_tokens(arch)
    assert warm["fxrt"].get("compiled", 0) == 0 and warm["fxrt"]["hit"] == pieces, warm["fxrt"]
    assert "not in fxrt's cache" not in warm["log"]


def test_stock_torch_compile_says_it_does_not_compile(tmp_path, model_dir, eager_tokens):
    # vLLM's CPU model runner never compiles in mode 1: fxrt's platform says so.
    llm = {"compilation_config": {"mode": 1, "backend": "fxrt"}}
    out = run_llm(tmp_path, model_dir("llama"), llm=llm, env={"FXRT_VLLM": "1"})
    assert out["tokens"] == eager_tokens("llama")
    assert "does not compile in STOCK_TORCH_COMPILE mode" in out["log"]
    assert out["fxrt"] is None or out["fxrt"].get("compiled", 0) == 0


def test_without_the_plugin_vllm_keeps_its_platform(tmp_path, model_dir):
    out = run_llm(
        tmp_path,
        model_dir("llama"),
        llm={"enforce_eager": True},
        env={"FXRT_VLLM": "0"},
        max_tokens=2,
    )
    assert out["platform"] == "CpuPlatform"


@pytest.mark.parametrize("executor", ["cpp", "python"])
def test_a_graph_fxrt_runs_partly_in_python(tmp_path, model_dir, eager_tokens, executor):
    # A model registered with vLLM whose output is scaled by a float of the token count: a
    # symbolic float expression, which fxrt runs as a Python fallback inside its loop.
    from conftest import SETUP

    env = {"FXRT_PURE_PYTHON": "1" if executor == "python" else "0", "FXRT_LOG": "info"}
    out = run_llm(
        tmp_path, model_dir("scaled_llama"), llm=TRACE_ONCE, env=env, setup=SETUP["scaled_llama"]
    )
    assert out["tokens"] == eager_tokens("scaled_llama")
    assert out["fxrt"]["compiled"] == 1 and out["fxrt"]["fallbacks"] >= 1, out["fxrt"]
