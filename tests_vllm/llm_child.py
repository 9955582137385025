"""One vLLM engine in this process: greedy tokens for token-id prompts, as JSON on the last line.

``python llm_child.py '{"model": ..., "llm": {...LLM keyword arguments...}, "prompts": [[...]],
"max_tokens": N}'``. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by
the tests), so what fxrt compiled and loaded is counted here.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def main() -> None:
    args = json.loads(sys.argv[1])
    if args.get("setup"):  # e.g. a model registered with vLLM (one-process engine: it sees it)
        import runpy

        runpy.run_path(args["setup"])
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    llm = LLM(
        model=args["model"],
        skip_tokenizer_init=True,
        dtype=args.get("dtype", "float32"),
        max_model_len=args.get("max_model_len", 128),
        seed=0,
        **args.get("llm", {}),
    )
    started = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=args.get("max_tokens", 8))
    prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "startup_s": started,
        "fxrt": None,
        "platform": type(current_platform).__name__,
    }
    if "fxrt" in sys.modules:
        import fxrt

        gc.unfreeze()  # vLLM freezes what start-up made: get_objects() would not see it
        # What vLLM's AOT-compiled functions call (fresh or loaded from vLLM's cache).
        called = [
            o._artifacts.compiled_fn
            for o in gc.get_objects()
            if type(o).__name__ == "AOTCompiledFunction"
        ]
        graphs = [getattr(f, "_owner", f) for f in called]
        result["fxrt"] = {
            **fxrt.cache.stats,
            "executor": fxrt.runtime_info()["executor"],
            "aot": sorted(type(f).__name__ for f in called),
            "fallbacks": sum(
                len(g.program.fallbacks) for g in graphs if isinstance(g, fxrt.CompiledGraph)
            ),
        }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
