"""Client-model tier: tiny random-weight HuggingFace ``transformers`` models through fxrt.

GPT-2, Llama, Qwen2, Mistral, Gemma, Gemma-2, BERT, the T5 encoder and OPT, built from config
objects (nothing is downloaded; 2 layers, hidden 64, vocab 128, fixed seed, eval mode, ``sdpa``
attention; Gemma-2's ``eager`` attention, the one that soft-caps its scores), on both fxrt loops,
each compared with eager:

- forward through ``torch.compile(model, backend="fxrt")`` with ``dynamic=False`` and ``True``
  over a few (batch, sequence) shapes;
- greedy ``generate`` on the decoder-only models with ``model.forward`` compiled, with the default
  dynamic KV cache (``dynamic`` left at its default) and with ``cache_implementation="static"``
  (``dynamic=False``): tokens must equal eager's exactly;
- warm runs: a child process (``clients_child.py``) compiles each forward and a short generate
  twice against one ``FXRT_CACHE_DIR``; both runs must match eager and the second must hit;
- ``fxrt.register_fx_wrapper()`` under ``torch.compile``'s default Inductor backend, on each
  forward and on GPT-2's static-cache generate.

Each in-process test gets a cache directory of its own, so no test sees another's cache entries;
cross-process reuse is the warm-run test's job.

A dynamic-shape compile of one of these models takes seconds, so the default quick set runs every
model's static forward and Inductor forward, but generate and warm runs only on GPT-2 and Llama,
dynamic forward only on Llama and the T5 encoder, and Inductor on one loop.
``FXRT_CLIENTS=full`` runs every model everywhere, both attention kinds (``sdpa``, ``eager``),
more shapes, every (KV cache, dynamic) pairing for generate, and Inductor on both loops.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from clients_child import CLIENTS, DECODERS, build, forward_output, greedy, input_ids
from conftest import EXECUTORS, native_available, recording_compiles, skip_unless_executor

import fxrt
from fxrt.exec.program import Kernel

FULL = os.environ.get("FXRT_CLIENTS", "quick") == "full"
MODELS = list(CLIENTS)
QUICK = MODELS if FULL else ["gpt2", "llama"]  # generate and warm runs
# Gemma-2: the soft-capped attention's fused call; Gemma-3: the norms of its transposed heads
WARM = QUICK if FULL else [*QUICK, "gemma2", "gemma3"]
INDUCTOR_MODELS = MODELS if FULL else [m for m in MODELS if m not in ("gemma2", "gemma3", "cohere")]
# dynamic=True forward; in the quick set GPT-2's dynamic shapes come from its generate test.
DYNAMIC = MODELS if FULL else ["llama", "t5_encoder"]
QUICK_DECODERS = [name for name in DECODERS if name in QUICK]
ATTENTION = ["sdpa", "eager"] if FULL else ["sdpa"]
SHAPES = [(1, 8), (2, 5), (3, 12), (4, 1)] if FULL else [(1, 8), (2, 5)]
PROMPTS = [(2, 8), (1, 5)] if FULL else [(2, 8)]
# (KV cache, torch.compile's dynamic): the dynamic cache grows every step, so it gets the default
# (static first, dynamic once a size changes); the static cache keeps its shapes.
GENERATE = [("dynamic", None), ("static", False)]
if FULL:
    GENERATE += [("dynamic", True), ("dynamic", False), ("static", True), ("static", None)]
INDUCTOR_EXECUTORS = EXECUTORS if FULL else ["cpp" if native_available() else "python"]
CHILD = Path(__file__).with_name("clients_child.py")

needs_cxx = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="Inductor's CPU backend needs a C++ compiler",
)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def fxrt_options(executor: str, cache_dir: Path) -> dict[str, Any]:
    return {"pure_python": executor == "python", "cache_dir": str(cache_dir)}


def cache_kwargs(cache: str) -> dict[str, Any]:
    return {} if cache == "dynamic" else {"cache_implementation": cache}


def assert_ran_on(built: list[fxrt.CompiledGraph], executor: str) -> None:
    assert built, "fxrt compiled no graph"
    assert {cg.executor for cg in built} == {executor}


def assert_kernels_native(built: list[fxrt.CompiledGraph]) -> None:
    """Inductor's C++ kernels in the host graphs are KERNEL instructions (C calls), none a
    Python fallback or a demotion."""
    programs = [cg.program for cg in built]
    assert any(isinstance(i, Kernel) for p in programs for i in p.code)
    for p in programs:
        assert not [n for n in p.fallbacks if n.startswith("cpp_")], p.fallbacks
        assert not p.demotions, p.demotions


def check_forward(model: Any, compiled: Any, name: str, shapes: list[tuple[int, int]]) -> None:
    for shape in shapes:
        ids = input_ids(*shape)
        got = forward_output(compiled, name, ids)
        torch.testing.assert_close(got, forward_output(model, name, ids), msg=f"shape {shape}")


def check_generate(model: Any, compiled_forward: Any, cache: str) -> None:
    """Greedy tokens with ``compiled_forward`` in place of ``model.forward`` equal eager's."""
    for prompt in PROMPTS:
        ids = input_ids(*prompt)
        expected = greedy(model, ids, **cache_kwargs(cache))
        model.forward = compiled_forward
        try:
            got = greedy(model, ids, **cache_kwargs(cache))
        finally:
            del model.forward  # back to the class's forward
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"prompt {prompt}")


# --- fxrt as the backend -----------------------------------------------------------------------


FORWARD = [(name, False) for name in MODELS] + [(name, True) for name in DYNAMIC]


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize(
    ("name", "dynamic"), FORWARD, ids=[f"{n}-{'dynamic' if d else 'static'}" for n, d in FORWARD]
)
def test_forward(name: str, attn: str, dynamic: bool, executor: str, tmp_path: Path) -> None:
    skip_unless_executor(executor)
    model = build(name, attn)
    options = fxrt_options(executor, tmp_path)
    with recording_compiles() as built:
        compiled = torch.compile(model, backend="fxrt", dynamic=dynamic, options=options)
        check_forward(model, compiled, name, SHAPES)
    assert_ran_on(built, executor)


@pytest.mark.parametrize(
    ("cache", "dynamic"), GENERATE, ids=[f"{c}_cache-dynamic_{d}" for c, d in GENERATE]
)
@pytest.mark.parametrize("name", QUICK_DECODERS)
def test_generate(
    name: str, cache: str, dynamic: bool | None, executor: str, tmp_path: Path
) -> None:
    skip_unless_executor(executor)
    model = build(name)
    options = fxrt_options(executor, tmp_path)
    with recording_compiles() as built:
        compiled = torch.compile(model.forward, backend="fxrt", dynamic=dynamic, options=options)
        check_generate(model, compiled, cache)
    assert_ran_on(built, executor)


# --- fused patterns on real decoders ------------------------------------------------------------

# Fused calls in the forward of a 2-layer decoder: the first norm, then each layer's two residual
# adds with the norm after them (the last one the final norm), one rotary call (q and k) and one
# gated MLP per layer. A change in transformers or in the matchers that stops a match fails here.
DECODER_PATTERNS = {"rms_norm": 1, "add_rms_norm": 4, "rotary": 2, "gated_mlp": 2}
# Gemma-2: four norms a layer (one fused with the residual add before it, two after a block's
# output), GELU-tanh gated MLPs, and its soft-capped attention over un-repeated K/V heads.
GEMMA2_PATTERNS = {
    "rms_norm": 5, "add_rms_norm": 4, "rotary": 2, "gated_mlp": 2, "gqa_softcap_attention": 2,
}  # fmt: skip
# Gemma-3: Gemma-2's norms plus q and k normalized per head after their transpose (in the
# transposed layout), GELU-tanh gated MLPs.
GEMMA3_PATTERNS = {"rms_norm": 9, "add_rms_norm": 4, "rotary": 2, "gated_mlp": 2}
# Cohere: its three LayerNorms (two layers' and the final one) written out, fused whole.
COHERE_PATTERNS = {"layer_norm": 3, "rotary": 2, "gated_mlp": 2}
PATTERNS = {
    **{name: DECODER_PATTERNS for name in ["llama", "qwen2", "mistral", "gemma"]},
    "gemma2": GEMMA2_PATTERNS,
    "gemma3": GEMMA3_PATTERNS,
    "cohere": COHERE_PATTERNS,
}
PATTERN_MODELS = list(PATTERNS)


@pytest.mark.skipif(not native_available(), reason="the fused ops are fxrt's own (the extension)")
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", PATTERN_MODELS)
def test_decoder_patterns(name: str, dynamic: bool, executor: str, tmp_path: Path) -> None:
    if dynamic and not FULL and name != "llama":
        pytest.skip("dynamic shapes on Llama only in the quick set (FXRT_CLIENTS=full: all)")
    skip_unless_executor(executor)
    model = build(name)
    options = fxrt_options(executor, tmp_path)
    shapes = [(2, 5), (2, 9), (2, 13)] if dynamic else SHAPES  # (batch 1 would specialize)
    with recording_compiles() as built:
        compiled = torch.compile(model, backend="fxrt", dynamic=dynamic, options=options)
        check_forward(model, compiled, name, shapes)
    assert_ran_on(built, executor)
    assert len(built) == (1 if dynamic else len(shapes))  # dynamic: one compile for all lengths
    assert [fxrt.pattern_counts(cg) for cg in built] == [PATTERNS[name]] * len(built)


# The same decoders in bfloat16, as a CPU deployment casts them: Llama-family norms widen to
# float32 and cast back before the weight, which fxrt::rms_norm computes for a bfloat16 input;
# rotary and the gated product in bfloat16 (Gemma's norm weights in float32: its unweighted-cast
# norms fuse as float32 ones, its residual adds stay).
BF16_PATTERNS = {
    "llama": DECODER_PATTERNS,
    "qwen2": DECODER_PATTERNS,
    "gemma": {"rms_norm": 5, "rotary": 2, "gated_mlp": 2},
    "gemma3": {"rms_norm": 13, "rotary": 2, "gated_mlp": 2},
    # Cohere's rotary multiplies q.float() by bfloat16 cos and sin: mixed dtypes keep their ops
    "cohere": {"layer_norm": 3, "gated_mlp": 2},
}


@pytest.mark.skipif(not native_available(), reason="the fused ops are fxrt's own (the extension)")
@pytest.mark.parametrize("name", list(BF16_PATTERNS))
def test_bfloat16_decoder_patterns(name: str, executor: str, tmp_path: Path) -> None:
    skip_unless_executor(executor)
    model = build(name).to(torch.bfloat16)
    options = fxrt_options(executor, tmp_path)
    with recording_compiles() as built:
        compiled = torch.compile(model, backend="fxrt", options=options)
        for shape in SHAPES[:2]:
            ids = input_ids(*shape)
            got = forward_output(compiled, name, ids).float()
            want = forward_output(model, name, ids).float()
            # each fused step within a bfloat16 ulp of eager's (docs/numerics.md)
            torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6, msg=f"shape {shape}")
    assert_ran_on(built, executor)
    assert [fxrt.pattern_counts(cg) for cg in built] == [BF16_PATTERNS[name]] * len(built)


# --- warm runs: a second process loads what the first one stored ------------------------------


def run_child(cache_dir: Path, executor: str, run: str) -> dict[str, Any]:
    """Run clients_child.py on ``executor``'s loop; it checks against eager and prints stats."""
    env = {
        **os.environ,
        "FXRT_CACHE": "1",
        "FXRT_CACHE_DIR": str(cache_dir),
        "FXRT_PURE_PYTHON": "1" if executor == "python" else "0",
    }
    args = ["--models", ",".join(WARM), "--new-tokens", "16" if FULL else "4"]
    proc = subprocess.run(
        [sys.executable, str(CHILD), *args], env=env, capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0:
        tops = [line for line in proc.stderr.splitlines() if line and not line[0].isspace()]
        pytest.fail(f"{run} run exited {proc.returncode}: {tops[-1:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_warm_cache(executor: str, tmp_path: Path) -> None:
    skip_unless_executor(executor)
    cold = run_child(tmp_path, executor, "cold")
    assert cold.get("stored", 0) > 0, cold
    assert cold["executors"] == [executor]
    warm = run_child(tmp_path, executor, "warm")
    assert warm.get("hit", 0) > 0, warm
    assert warm.get("compiled", 0) == 0, warm  # static shapes only: every graph was stored
    assert warm["executors"] == [executor]
    # the loaded graphs hold the fused calls the compiled ones did (Llama's forward among them)
    assert warm["patterns"] == cold["patterns"]
    assert DECODER_PATTERNS in cold["patterns"], cold["patterns"]
    assert GEMMA2_PATTERNS in cold["patterns"], cold["patterns"]
    assert GEMMA3_PATTERNS in cold["patterns"], cold["patterns"]


# --- fxrt as Inductor's host-wrapper executor --------------------------------------------------


@contextlib.contextmanager
def fx_wrapper(executor: str, cache_dir: Path) -> Iterator[None]:
    config = fxrt.CompilerConfig(pure_python=executor == "python", cache_dir=str(cache_dir))
    fxrt.register_fx_wrapper(config)
    try:
        yield
    finally:
        fxrt.unregister_fx_wrapper()


@needs_cxx
@pytest.mark.parametrize("executor", INDUCTOR_EXECUTORS)
@pytest.mark.parametrize("name", INDUCTOR_MODELS)
def test_inductor_forward(name: str, executor: str, tmp_path: Path) -> None:
    skip_unless_executor(executor)
    model = build(name)
    with fx_wrapper(executor, tmp_path), recording_compiles() as built:
        compiled = torch.compile(model)
        check_forward(model, compiled, name, SHAPES if FULL else SHAPES[1:])
    assert_ran_on(built, executor)
    assert_kernels_native(built)


@needs_cxx
@pytest.mark.parametrize("executor", INDUCTOR_EXECUTORS)
def test_inductor_generate_gpt2_static(executor: str, tmp_path: Path) -> None:
    skip_unless_executor(executor)
    model = build("gpt2")
    with fx_wrapper(executor, tmp_path), recording_compiles() as built:
        compiled = torch.compile(model.forward, dynamic=False)
        check_generate(model, compiled, "static")
    assert_ran_on(built, executor)
    assert_kernels_native(built)
