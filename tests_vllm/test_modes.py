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
